"""The simulator runs the router's own core over N inline mock replicas on the virtual clock."""

from __future__ import annotations

from trillm.bench.simulate import simulate_router
from trillm.engine.config import EngineConfig
from trillm.engine.mock import MockModelSpec, make_mock_engine, multi_turn_trace

SPEC = MockModelSpec(name="sim", vocab_size=1000, max_model_len=8192)


def factory():  # type: ignore[no-untyped-def]
    return make_mock_engine(EngineConfig(num_kv_blocks=2048, max_num_seqs=16), spec=SPEC)


TRACE = multi_turn_trace(num_conversations=12, num_turns=4, turn_tokens=256, output_len=16, system_tokens=256,
                         block_tokens=64, turn_gap_s=1.0, stagger_s=0.1)


def hit_rate(res) -> float:  # type: ignore[no-untyped-def]
    recs = res.result.records
    return sum(r.cached_tokens or 0 for r in recs) / sum(r.prompt_tokens or 0 for r in recs)


def test_kv_policy_over_simulated_replicas_beats_round_robin_on_multi_turn() -> None:
    kv = simulate_router(TRACE, factory, num_replicas=4, policy="kv", vocab_size=SPEC.vocab_size, block_tokens=64)
    rr = simulate_router(TRACE, factory, num_replicas=4, policy="round-robin", vocab_size=SPEC.vocab_size,
                         block_tokens=64)
    for res in (kv, rr):
        assert len(res.result.records) == len(TRACE) and all(r.success for r in res.result.records)
        assert sum(res.routed.values()) == len(TRACE) and min(res.routed.values()) > 0  # every replica served
        assert res.result.live_after == 0 and res.num_resyncs == 0
        assert all(s is not None and s.num_blocks_used == 0 for s in res.per_replica.values())
        assert res.result.virtual_s >= TRACE[-1].timestamp / 1000
    # The most a router can reuse: every turn after the first finds its previous prompt (the trace's
    # assistant turns are not what the mock generated, so they are new tokens).
    best = sum(r.input_length - 4 * 64 for r in TRACE if r.input_length > 8 * 64) / sum(r.input_length for r in TRACE)
    assert hit_rate(kv) >= 0.95 * best
    assert hit_rate(kv) >= 1.5 * hit_rate(rr)
    ttft = sorted(r.ttft for r in kv.result.records if r.ttft is not None)
    ttft_rr = sorted(r.ttft for r in rr.result.records if r.ttft is not None)
    assert ttft[len(ttft) // 2] < ttft_rr[len(ttft_rr) // 2]  # less prefill: sooner first tokens


def test_routed_simulation_is_deterministic() -> None:
    a = simulate_router(TRACE, factory, num_replicas=3, vocab_size=SPEC.vocab_size, block_tokens=64)
    b = simulate_router(TRACE, factory, num_replicas=3, vocab_size=SPEC.vocab_size, block_tokens=64)
    assert [r.chunk_times for r in a.result.records] == [r.chunk_times for r in b.result.records]
    assert a.routed == b.routed
