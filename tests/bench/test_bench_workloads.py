"""Workload and arrival generators: seeded, deterministic, and with the lengths and shapes they promise."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest

from trillm.bench.harness import workloads as W
from trillm.bench.harness.arrival import Arrival, start_offsets


@pytest.mark.parametrize("name", W.WORKLOADS)
def test_every_workload_is_deterministic_per_seed(name: str) -> None:
    spec = W.WorkloadSpec(num_prompts=8, input_len=40, output_len=8, long_len=64, system_len=30)
    a, b = W.build(name, spec), W.build(name, spec)
    assert a.requests == b.requests and len(a.requests) == 8
    other = W.build(name, dataclasses.replace(spec, seed=1))
    assert other.requests != a.requests
    assert len({r.request_id for r in a.requests}) == len(a.requests)


def test_random_lengths_stay_in_range() -> None:
    wl = W.random_lengths(200, 100, 50, range_ratio=0.2, seed=3)
    for r in wl.requests:
        assert r.prompt is not None and len(r.prompt.split()) == r.prompt_words
        assert 80 <= r.prompt_words <= 120 and 40 <= r.max_tokens <= 60
    assert len({r.prompt_words for r in wl.requests}) > 10
    with pytest.raises(ValueError):
        W.random_lengths(1, 10, 10, range_ratio=1.0)


def test_fixed_lengths_are_exact() -> None:
    wl = W.fixed("long", 3, 500, 7)
    assert all(len(r.prompt.split()) == 500 and r.max_tokens == 7 for r in wl.requests)  # type: ignore[union-attr]
    assert len({r.prompt for r in wl.requests}) == 3  # no accidental shared prefix


def test_multi_turn_prompts_grow_on_a_shared_prefix() -> None:
    wl = W.multi_turn(num_conversations=2, num_turns=3, user_len=5, assistant_len=6, output_len=4, system_len=10)
    units = wl.sessions()
    assert len(units) == 2 and [r.turn for r in units[0]] == [0, 1, 2]
    for unit in units:
        for prev, cur in zip(unit, unit[1:]):
            assert prev.messages is not None and cur.messages is not None
            assert cur.messages[: len(prev.messages)] == prev.messages  # the previous prompt is a prefix
            assert cur.messages[len(prev.messages)][0] == "assistant"
            assert cur.prompt_words == prev.prompt_words + 6 + 5
    assert units[0][0].messages[0][0] == "system"  # type: ignore[index]
    assert units[0][0].messages != units[1][0].messages


def test_shared_prefix_shares_exactly_the_system_prompt() -> None:
    wl = W.shared_prefix(5, system_len=50, question_len=5, output_len=3)
    systems = {r.messages[0] for r in wl.requests}  # type: ignore[index]
    assert len(systems) == 1 and len(next(iter(systems))[1].split()) == 50
    assert len({r.messages[1] for r in wl.requests}) == 5  # type: ignore[index]


def test_sharegpt_lengths_follow_the_documented_lognormal() -> None:
    wl = W.sharegpt_like(4000, max_input=10**6, max_output=10**6, seed=7)
    ins = [r.prompt_words for r in wl.requests]
    outs = [r.max_tokens for r in wl.requests]
    assert statistics.mean(ins) == pytest.approx(W.SHAREGPT_INPUT_MEAN, rel=0.1)
    assert statistics.mean(outs) == pytest.approx(W.SHAREGPT_OUTPUT_MEAN, rel=0.1)
    # log-normal: the median is mean * exp(-sigma^2 / 2)
    assert statistics.median(ins) == pytest.approx(W.SHAREGPT_INPUT_MEAN * math.exp(-0.5), rel=0.1)
    small = W.sharegpt_like(50, scale=0.1, max_input=64, max_output=32)
    assert max(r.prompt_words for r in small.requests) <= 64 and max(r.max_tokens for r in small.requests) <= 32


def test_gamma_arrivals_rate_and_burstiness() -> None:
    assert start_offsets(4, math.inf) == [0.0] * 4
    assert start_offsets(50, 5.0, 1.0, seed=1) == start_offsets(50, 5.0, 1.0, seed=1)
    for shape in (0.5, 1.0, 4.0):
        t = start_offsets(6000, 10.0, shape, seed=2)
        gaps = [b - a for a, b in zip(t, t[1:])]
        assert t[0] == 0.0
        assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.06)
        cv = statistics.pstdev(gaps) / statistics.mean(gaps)
        assert cv == pytest.approx(1 / math.sqrt(shape), rel=0.1)  # gamma: CV^2 = 1 / shape


def test_arrival_validation_and_labels() -> None:
    assert Arrival("concurrency", 8).label == "c8"
    assert Arrival("rate", None, 2.0, 0.5).label == "r2-b0.5"
    assert Arrival("burst").label == "burst"
    with pytest.raises(ValueError):
        Arrival("concurrency")
    with pytest.raises(ValueError):
        Arrival("sometimes")


def test_code_edit_asks_to_rewrite_the_file_it_sends() -> None:
    from trillm.bench.harness.prompts import CODE_FILE, CODE_TASK

    wl = W.build("code-edit", W.WorkloadSpec(num_prompts=5, output_len=160))
    assert wl.name == "code-edit" and len(wl.requests) == 5
    for r in wl.requests:
        assert r.is_chat and r.max_tokens == 160 and r.messages is not None and len(r.messages) == 1
        role, text = r.messages[0]
        assert role == "user" and CODE_FILE in text and "Reply with the whole updated file" in text
        assert r.prompt_words == len(text.split())
    assert wl.requests[0].messages == (("user", CODE_TASK),)  # seed 0 starts with the engine benchmark's edit
    assert len({r.messages for r in wl.requests[:4]}) == 4  # four different renames, then they cycle


def test_chat_sends_each_question_once() -> None:
    from trillm.bench.harness.prompts import CHAT

    wl = W.chat(16, output_len=128)
    texts = [r.messages[0][1] for r in wl.requests]  # type: ignore[index]
    assert len(set(texts)) == 16 and all(r.max_tokens == 128 and r.is_chat for r in wl.requests)
    assert texts[0] == f"{CHAT[0]} (#0)" and texts[9] == f"{CHAT[1]} (#9)"
