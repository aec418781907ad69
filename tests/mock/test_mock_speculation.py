"""Speculation in the mock engine: proposals accepted at the given rate, verify steps priced as a decode plus
the proposed tokens at the prefill's per-token rate, the same tokens as without speculation, and `simulate`
planning with it."""

from __future__ import annotations

from typing import Any

import pytest

from trillm.bench.simulate import simulate
from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.mock import LinearCostModel, MockModelSpec, MockRunner, StepShape, TraceRequest, make_mock_engine
from trillm.engine.sampling_params import SamplingParams

SPEC = MockModelSpec(name="sim", vocab_size=1000, max_model_len=4096)
MODEL = LinearCostModel(2e-3, 3e-4, 1e-6, 4e-3, 1e-4, 1e-9)


def mock(acceptance: float, **kw: Any) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=8, speculative_max_batch=8, **kw)
    return make_mock_engine(config, spec=SPEC, perf=MODEL, spec_acceptance=acceptance)


def generate(eng: LLMEngine, n: int = 4, max_tokens: int = 41) -> list[tuple[int, ...]]:
    ps = [[10 + i] * (50 + i) for i in range(n)]
    return [o.new_token_ids for o in eng.generate(ps, SamplingParams(max_tokens=max_tokens, temperature=0.0))]


def test_acceptance_rate_sets_the_accepted_tokens_and_the_output_is_unchanged() -> None:
    ref = generate(mock(0.7))  # speculation off
    rates = {}
    for a in (0.0, 0.5, 0.9, 1.0):
        eng = mock(a, speculative="ngram", num_speculative_tokens=4)
        assert generate(eng) == ref
        s = eng.statistics()
        assert s.spec_verifies > 0
        rates[a] = s.spec_accepted_tokens / s.spec_draft_tokens
    assert rates[0.0] == 0.0 and rates[1.0] == 1.0
    # Accepted tokens are the leading hits of each proposal: for k = 4, E = sum_j a^j / 4 (k shrinks a little
    # after misses, so the figure sits near, not on, the fixed-k value).
    for a in (0.5, 0.9):
        assert abs(rates[a] - sum(a**j for j in range(1, 5)) / 4) < 0.12, rates


def test_a_verify_step_costs_a_decode_plus_its_proposed_tokens_at_the_prefill_rate() -> None:
    eng = mock(1.0, speculative="ngram", num_speculative_tokens=4)
    generate(eng, n=1, max_tokens=41)  # the prefill's token, then 8 verifies of 1 + 4 tokens
    runner = eng.runner
    assert isinstance(runner, MockRunner)
    want = MODEL.step_seconds(StepShape(prefill_chunks=((50, 0),)))
    for i in range(8):
        ctx = 51 + 5 * i
        want += MODEL.step_seconds(StepShape(decode_contexts=(ctx,), verify_rows=((4, ctx),)))
    assert runner.num_steps == 9
    assert runner.total_step_s == pytest.approx(want, rel=1e-9)
    assert MODEL.verify_seconds([(4, 100)]) == pytest.approx(4e-4 + 1e-9 * 4 * 102.5)


def test_a_draft_models_proposals_cost_k_of_its_decode_steps() -> None:
    """--spec-draft-cost F: before each verify the draft decodes the row k times, each at F of the target's
    decode of that context; n-gram's proposals (F = 0) stay free."""
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=8, speculative_max_batch=8, speculative="ngram",
                          num_speculative_tokens=4)
    eng = make_mock_engine(config, spec=SPEC, perf=MODEL, spec_acceptance=1.0, spec_draft_cost=0.25)
    generate(eng, n=1, max_tokens=41)
    free = mock(1.0, speculative="ngram", num_speculative_tokens=4)
    generate(free, n=1, max_tokens=41)
    runner, free_runner = eng.runner, free.runner
    assert isinstance(runner, MockRunner) and isinstance(free_runner, MockRunner)
    draft = sum(MODEL.step_seconds(StepShape(decode_contexts=(51 + 5 * i + j,))) for i in range(8) for j in range(4))
    assert runner.total_step_s == pytest.approx(free_runner.total_step_s + 0.25 * draft, rel=1e-9)
    with pytest.raises(ValueError, match="draft's cost"):
        MockRunner(MODEL, vocab_size=1000, num_blocks=8, spec_draft_cost=-1.0)


def test_simulate_plans_with_speculation() -> None:
    trace = [TraceRequest(i * 50, 200, 64) for i in range(6)]

    def factory(**kw: Any) -> Any:
        return lambda: mock(0.8, **kw)

    off = simulate(trace, factory(), vocab_size=SPEC.vocab_size)
    on = simulate(trace, factory(speculative="ngram"), vocab_size=SPEC.vocab_size)
    assert sum(r.completion_tokens for r in on.records) == sum(r.completion_tokens for r in off.records) == 6 * 64
    assert on.final_stats.spec_accepted_tokens > 0
    # Fewer, longer steps: the output comes in fewer deltas, sooner.
    assert sum(len(r.chunk_times) for r in on.records) < sum(len(r.chunk_times) for r in off.records)
    assert sum(r.chunk_times[-1] for r in on.records) < sum(r.chunk_times[-1] for r in off.records)


def test_speculation_holds_off_where_a_verify_costs_more_than_it_brings() -> None:
    """A timing model whose extra positions cost a whole decode each (the verify of L positions ~ L decodes):
    accepting half the proposals loses, so the speculator stops, and measures again later; where the extra
    positions are cheap it keeps speculating."""
    def run(per_token_s: float) -> LLMEngine:
        perf = LinearCostModel(2e-3, 3e-4, 1e-9, 4e-3, per_token_s, 1e-12)
        config = EngineConfig(num_kv_blocks=512, max_num_seqs=8, speculative="ngram", num_speculative_tokens=8)
        eng = make_mock_engine(config, spec=SPEC, perf=perf, spec_acceptance=0.5)
        eng.generate([[11] * 40], SamplingParams(max_tokens=600, temperature=0.0))
        return eng

    dear, cheap = run(2.5e-3), run(1e-5)
    assert dear.speculator is not None and cheap.speculator is not None
    assert dear.speculator.rates.num_holds >= 1 and cheap.speculator.rates.num_holds == 0
    assert dear.statistics().spec_verifies < cheap.statistics().spec_verifies / 2
