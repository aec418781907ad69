"""Prefix caching for hybrid models through recurrent-state checkpoints (engine/state_checkpoints.py): a
conversation's second and third turns prefill only their new tokens plus less than one checkpoint interval, and
their output is the uncached engine's and mlx-lm's own; checkpoints go with their blocks when those are
evicted; a preempted sequence resumes from one; an abort mid-prefill leaves no slot or pending copy behind; and
the bookkeeping holds its invariants through any sequence of admissions, publications and frees."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st

import model_zoo as zoo
from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel, load_model
from trillm.engine.outputs import RequestOutput
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduler import PrefillChunk
from trillm.engine.sequence import Sequence
from trillm.engine.state_checkpoints import StateCheckpoints, prefill_phases
from trillm.engine.state_pool import StateSlots

BS = 8
INTERVAL = 2  # blocks: a checkpoint every 16 tokens
EVERY = BS * INTERVAL


def _params(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)


def _engine(lm: LoadedModel, **kw: object) -> LLMEngine:
    config: dict[str, object] = dict(block_size=BS, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                     state_checkpoint_interval=INTERVAL, verify_model=False)
    config.update(kw)
    return LLMEngine(EngineConfig(**config), loaded=lm)  # type: ignore[arg-type]


def _mlx_lm(model: object, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    from mlx_lm.generate import generate_step

    tokens, lps = [], []
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=n,  # type: ignore[arg-type]
                                       sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(tok))
        lps.append(float(logprobs.reshape(-1)[int(tok)]))
    return tokens, lps


def _same(a: RequestOutput, b: RequestOutput | tuple[list[int], list[float]]) -> None:
    tokens, lps = ((list(b.new_token_ids), [lp.logprob for lp in b.logprobs or ()]) if isinstance(b, RequestOutput)
                   else b)
    assert list(a.new_token_ids) == tokens
    got = [lp.logprob for lp in a.logprobs or ()]
    assert max(abs(x - y) for x, y in zip(got, lps)) < 1e-3


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h"])  # ragged rows, and one-length forwards
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = zoo.build(request.param, tmp_path_factory.mktemp("ck") / request.param)
    return load_model(str(path))


def test_multi_turn_prefills_only_the_new_tokens(hybrid: LoadedModel) -> None:
    prompts = zoo.matrix_prompts()
    cached, uncached = _engine(hybrid), _engine(hybrid, enable_prefix_caching=False)
    history = {"cached": list(prompts["long"]), "uncached": list(prompts["long"])}
    for turn, new in enumerate([(), prompts["medium"], prompts["short"]]):
        outs = {}
        for name, eng in (("cached", cached), ("uncached", uncached)):
            history[name] += list(new)
            outs[name] = eng.generate([history[name]], _params())[0]
            history[name] += list(outs[name].new_token_ids)
        _same(outs["cached"], outs["uncached"])
        prompt = history["cached"][: -len(outs["cached"].new_token_ids)]
        _same(outs["cached"], _mlx_lm(hybrid.model, prompt, 8))
        assert outs["uncached"].usage.cached_tokens == 0
        if turn == 0:
            assert outs["cached"].usage.cached_tokens == 0
            continue
        # The previous turn computed its prompt and all but its last generated token; the hit resumes at the
        # last checkpoint at or below that: this turn prefills its new tokens plus less than one interval.
        prefilled = len(prompt) - outs["cached"].usage.cached_tokens
        assert outs["cached"].usage.cached_tokens > 0
        assert prefilled <= len(new) + 1 + EVERY - 1, (prefilled, len(new))
    ck = cached.state_slots.checkpoints  # type: ignore[union-attr]
    assert ck is not None and ck.num_restored == 2
    cached.block_manager.check_invariants([])


def test_eviction_drops_the_checkpoints_of_evicted_blocks(hybrid: LoadedModel) -> None:
    prompts = zoo.matrix_prompts()
    eng = _engine(hybrid, num_kv_blocks=12)  # 11 usable blocks: one 57 + 8 token request fills most of them
    first = eng.generate([list(prompts["long"])], _params())[0]
    ck = eng.state_slots.checkpoints  # type: ignore[union-attr]
    assert ck is not None and ck.statistics().num_saved == 2  # at 48 (the prompt's one chunk) and 64 (decoding)
    saved = set(ck._saved)
    eng.generate([list(prompts["ragged"]) * 2], _params())  # 46 other tokens: evicts most of the first's blocks
    eng.block_manager.check_invariants([])  # every checkpoint left is keyed by a block still cached
    assert saved - set(ck._saved), "no checkpoint went with its evicted blocks"
    again = eng.generate([list(prompts["long"])], _params())[0]
    _same(again, first)
    assert again.usage.cached_tokens < first.usage.prompt_tokens - EVERY


def test_a_preempted_sequence_resumes_from_a_checkpoint(hybrid: LoadedModel) -> None:
    prompts = zoo.matrix_prompts()
    names = ["long", "ragged", "medium", "short"]
    eng = _engine(hybrid, num_kv_blocks=12, max_num_seqs=8, pipeline_decode=False)
    outs = eng.generate([list(prompts[n]) for n in names], _params(16))
    assert eng.statistics().num_preemptions > 0
    ck = eng.state_slots.checkpoints  # type: ignore[union-attr]
    assert ck is not None and ck.num_restored > 0, "no preempted sequence resumed from a checkpoint"
    for name, out in zip(names, outs):
        _same(out, _mlx_lm(hybrid.model, list(prompts[name]), 16))
    assert eng.statistics().num_blocks_used == 0 and ck.statistics().num_pending == 0


def test_abort_mid_prefill_frees_the_slot_and_pending_checkpoints(hybrid: LoadedModel) -> None:
    eng = _engine(hybrid, max_num_batched_tokens=24)  # chunks of 24: the first ends past the 16-token boundary
    eng.add_request("a", list(zoo.matrix_prompts()["long"]), _params())
    eng.step()
    ck, slots = eng.state_slots.checkpoints, eng.state_slots  # type: ignore[union-attr]
    assert ck is not None and slots is not None
    seq = eng.scheduler.running[0]
    assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens and ck.statistics().num_saved == 1
    eng.abort("a")
    assert slots.num_free == slots.num_slots and ck.statistics().num_pending == 0 and not ck.restores
    eng.block_manager.check_invariants([])
    out = eng.generate([list(zoo.matrix_prompts()["long"])], _params())[0]  # resumes from the aborted one's
    assert out.usage.cached_tokens == EVERY
    _same(out, _mlx_lm(eng.loaded.model, list(zoo.matrix_prompts()["long"]), 8))  # type: ignore[union-attr]


def test_prefill_phases_cut_each_chunk_at_its_last_boundary() -> None:
    ck = StateCheckpoints(INTERVAL, 4, BS)
    seqs = [Sequence(str(i), list(range(100)), _params()) for i in range(4)]
    chunks = [PrefillChunk(seqs[0], 0, 40), PrefillChunk(seqs[1], 16, 16), PrefillChunk(seqs[2], 5, 6),
              PrefillChunk(seqs[3], 20, 30)]
    phases = prefill_phases(chunks, ck, lambda c, a, n: PrefillChunk(c.seq, a, n))
    assert [[(c.seq.request_id, c.start, c.num_tokens) for c in p] for p in phases] == [
        [("0", 0, 32), ("1", 16, 16), ("2", 5, 6), ("3", 20, 28)], [("0", 32, 8), ("3", 48, 2)]]
    assert prefill_phases(chunks, None, lambda c, a, n: c) == [chunks]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "compute", "free"]), st.integers(0, 5), st.integers(1, 40)),
                max_size=50))
def test_checkpoints_are_keyed_by_cached_blocks(ops: list[tuple[str, int, int]]) -> None:
    # Pure bookkeeping, as the engine drives it: a sequence computes tokens (a checkpoint at each boundary it
    # reaches), publishes its blocks, is freed; admissions resume only at a checkpointed boundary.
    ck = StateCheckpoints(1, 3, 4)
    slots = StateSlots(3, ck)
    bm = BlockManager(16, 4, state_slots=slots)
    tokens = [list(range(k, k + 40)) for k in (0, 0, 0, 100, 100, 200)]  # shared prefixes
    live: dict[int, Sequence] = {}
    for op, i, n in ops:
        seq = live.get(i)
        if op == "admit" and seq is None:
            seq = Sequence(str(i), tokens[i][:n], _params())
            if bm.can_allocate(seq):
                bm.allocate(seq)
                live[i] = seq
                assert seq.num_computed_tokens % 4 == 0
                if seq.num_computed_tokens:
                    assert seq in ck.restores and seq.block_hashes[seq.num_computed_tokens // 4 - 1] in ck._saved
        elif op == "compute" and seq is not None and seq.num_pending_tokens > 0:
            step = min(n, seq.num_pending_tokens)
            if not bm.can_append(seq, step):
                continue
            bm.may_append(seq, step)
            ck.restores.pop(seq, None)  # the state pool applies it before the forward
            for end in range(seq.num_computed_tokens + 1, seq.num_computed_tokens + step + 1):
                if ck.is_boundary(end):
                    ck.save(seq, end, ())
            seq.num_computed_tokens += step
            bm.register_computed(seq)
            assert ck.statistics().num_pending == 0  # every saved boundary's block is now published
        elif op == "free" and seq is not None:
            bm.deallocate(live.pop(i))
        bm.check_invariants(list(live.values()))
        assert ck.statistics().num_saved <= 3
    for seq in live.values():
        bm.deallocate(seq)
    bm.check_invariants([])
    assert ck.statistics().num_pending == 0 and not ck.restores and slots.num_free == 3
