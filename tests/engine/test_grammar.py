"""Constrained decoding: the sampler's masks (property tests), the engine's matchers, and clean failures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import trillm.kernels  # noqa: F401  (BLAS first)

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest
from trillm.engine.grammar import GrammarSpec, allowed_tokens, bitmask_width, grammar_compiler
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.mock import MockModelSpec, make_mock_engine
from trillm.engine.outputs import FinishReason
from trillm.engine.sampler import Sampler, SampleRow
from trillm.engine.sampling_params import SamplingParams


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [V] -> the int32 bitmask row llguidance writes (bit t % 32 of word t // 32)."""
    width = bitmask_width(len(allowed))
    bits = np.zeros(width * 32, dtype=np.uint8)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


@st.composite
def batches(draw: st.DrawFn) -> tuple[np.ndarray, list[SampleRow], list[np.ndarray | None]]:
    n = draw(st.integers(1, 6))
    v = draw(st.integers(2, 100))
    logits = np.array(draw(st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=n * v, max_size=n * v)),
                      np.float32).reshape(n, v)
    rows, masks = [], []
    for i in range(n):
        mask = None
        if draw(st.booleans()):
            allowed = np.array(draw(st.lists(st.booleans(), min_size=v, max_size=v)))
            allowed[draw(st.integers(0, v - 1))] = True  # a grammar always allows something
            mask = allowed
        temperature = draw(st.sampled_from([0.0, 0.7, 1.5]))
        top_k = draw(st.sampled_from([0, 1, 3]))
        top_p = draw(st.sampled_from([1.0, 0.5]))
        bias = tuple((t, -5.0) for t in draw(st.lists(st.integers(0, v - 1), max_size=3, unique=True)))
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i, logit_bias=bias)
        rows.append(SampleRow(params, 0, [1], [], (), None if mask is None else pack(mask)))
        masks.append(mask)
    return logits, rows, masks


@settings(max_examples=60, deadline=None)
@given(batches())
def test_constrained_rows_only_sample_allowed_tokens(batch: tuple[np.ndarray, list[SampleRow], list[np.ndarray | None]]) -> None:
    logits, rows, masks = batch
    sampler = Sampler(seed=0)
    tokens = sampler.read(sampler.sample(mx.array(logits), rows)).token_ids
    for i, (token, mask) in enumerate(zip(tokens, masks)):
        if mask is not None:
            assert mask[token], (i, token)
            if rows[i].params.greedy:  # the independent truth: argmax over the allowed logits, biases applied
                biased = logits[i].copy()
                for t, b in rows[i].params.logit_bias:
                    biased[t] += b
                assert token == int(np.argmax(np.where(mask, biased, -np.inf)))


@settings(max_examples=40, deadline=None)
@given(batches())
def test_each_row_samples_as_it_would_alone(batch: tuple[np.ndarray, list[SampleRow], list[np.ndarray | None]]) -> None:
    logits, rows, _ = batch
    together = Sampler(seed=0).read(Sampler(seed=0).sample(mx.array(logits), rows)).token_ids
    for i, row in enumerate(rows):
        alone = Sampler(seed=0)
        (token,) = alone.read(alone.sample(mx.array(logits[i : i + 1]), [row])).token_ids
        assert token == together[i]  # every row here is seeded, so sampled rows must agree too


def test_bitmask_round_trip() -> None:
    allowed = np.zeros(70, bool)
    allowed[[0, 31, 32, 69]] = True
    assert list(np.flatnonzero(allowed_tokens(pack(allowed), 70))) == [0, 31, 32, 69]


def tiny_engine(path: Path, **config: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=128,
                                  **config))  # type: ignore[arg-type]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."


def test_mixed_batch_matches_each_request_alone(tiny_model_path: Path) -> None:
    """Constrained and unconstrained greedy requests in one batch give exactly what each gives alone, and the
    constrained outputs match their grammars even though the model is random."""
    engine = tiny_engine(tiny_model_path)
    prompts = [engine.tokenizer.encode(f"Hello {i} world") for i in range(6)]
    grammars = [GrammarSpec("json_schema", json.dumps(PERSON)), None, GrammarSpec("regex", WORDS), None,
                GrammarSpec("lark", 'start: "yes" | "no" | "maybe"'), None]
    params = [SamplingParams(max_tokens=256, temperature=0.0, grammar=g, ignore_eos=g is None) for g in grammars]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], [q])[0] for p, q in zip(prompts, params)]
    assert [o.new_text for o in together] == [o.new_text for o in alone]
    jsonschema.validate(json.loads(together[0].new_text), PERSON)
    assert re.fullmatch(WORDS, together[2].new_text) and together[4].new_text in ("yes", "no", "maybe")
    assert all(together[i].finish_reason is FinishReason.STOP for i in (0, 2, 4))  # complete: ended at once
    assert all(together[i].finish_reason is FinishReason.LENGTH for i in (1, 3, 5))


def test_constrained_rows_are_never_launched_ahead(tiny_model_path: Path) -> None:
    engine = tiny_engine(tiny_model_path)
    assert engine._pipelined  # the tiny model's runner pipelines decode steps
    engine.add_request("u", engine.tokenizer.encode("one two"), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("c", engine.tokenizer.encode("three"),
                       SamplingParams(max_tokens=20, grammar=GrammarSpec("regex", "[a-z ]{20}")))
    while any(s.grammar is not None for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
        assert not engine.has_step_in_flight
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("u2", engine.tokenizer.encode("one two"), SamplingParams(max_tokens=20, ignore_eos=True))
    seen_ahead = False
    while engine.has_unfinished_requests():
        engine.step()
        seen_ahead |= engine.has_step_in_flight
    assert seen_ahead  # alone, an unconstrained request keeps the pipeline


def test_invalid_grammars_are_refused_with_the_reason(tiny_model: LoadedModel) -> None:
    compiler = grammar_compiler(tiny_model.tokenizer)
    with pytest.raises(InvalidRequest, match="Invalid type"):
        compiler.validate(GrammarSpec("json_schema", '{"type": "nonsense"}'))
    with pytest.raises(InvalidRequest, match="unclosed group"):
        compiler.validate(GrammarSpec("regex", "a(b"))
    with pytest.raises(InvalidRequest, match="invalid lark"):
        compiler.validate(GrammarSpec("lark", "start: @@@"))
    with pytest.raises(InvalidRequest, match="invalid json schema"):
        compiler.validate(GrammarSpec("json_schema", "{not json"))


def test_an_unsatisfiable_grammar_ends_only_its_request() -> None:
    """The mock's word vocabulary cannot spell '{': the grammar engine finds no token, and that request ends
    with finish reason "grammar" while its neighbour runs on."""
    engine = make_mock_engine(EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64),
                              spec=MockModelSpec(name="m", vocab_size=500, max_model_len=512))
    schema = GrammarSpec("json_schema", json.dumps(PERSON))
    stuck, free = engine.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=8, grammar=schema),
                                                         SamplingParams(max_tokens=8, ignore_eos=True)])
    assert stuck.finish_reason is FinishReason.GRAMMAR and stuck.error and stuck.new_token_ids == ()
    assert free.finish_reason is FinishReason.LENGTH and len(free.new_token_ids) == 8
    assert engine.block_manager.num_used_blocks == 0
