"""The simulator: the mock engine in an inline EngineService on trio's virtual clock."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trillm.bench.simulate import simulate
from trillm.engine.config import EngineConfig
from trillm.engine.mock import (
    LinearCostModel, MockModelSpec, StepShape, TraceRequest, make_mock_engine, synthetic_trace,
)
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduler import ScheduledBatch
from trillm.web.service.engine_service import EngineService, ServiceConfig

IDLE_STEP_S = ServiceConfig().idle_step_s

SPEC = MockModelSpec(name="sim", vocab_size=1000, max_model_len=4096)
MODEL = LinearCostModel(2e-3, 3e-4, 1e-6, 4e-3, 1e-4, 1e-9)


def factory(config: EngineConfig | None = None, perf: Any = MODEL) -> Any:
    return lambda: make_mock_engine(config or EngineConfig(num_kv_blocks=256, max_num_seqs=8), spec=SPEC, perf=perf)


def test_trace_gives_exactly_n_times_max_tokens_and_ends_idle() -> None:
    trace = [TraceRequest(r.timestamp, r.input_length, 12, r.hash_ids)
             for r in synthetic_trace(num_requests=40, rate=20.0, input_len=200, block_tokens=64, seed=2)]
    res = simulate(trace, factory(), vocab_size=SPEC.vocab_size, block_tokens=64)
    assert len(res.records) == 40 and all(r.success for r in res.records)
    assert sum(r.completion_tokens for r in res.records) == 40 * 12
    assert all(len(r.chunk_times) == 12 for r in res.records)  # the client kept up: one token per delta
    s = res.final_stats
    assert (s.num_running, s.num_waiting, s.num_blocks_used, res.live_after) == (0, 0, 0, 0)
    assert s.prefix_cache_hits > 0  # the trace's shared prefixes were found
    assert res.virtual_s >= trace[-1].timestamp / 1000


def test_times_follow_the_timing_model_exactly() -> None:
    # One request alone: its first token comes after one prefill step, each next one after one decode step.
    res = simulate([TraceRequest(0, 100, 5)], factory(), vocab_size=SPEC.vocab_size)
    (rec,) = res.records
    want, t = [], MODEL.step_seconds(StepShape(prefill_chunks=((100, 0),)))
    want.append(t)
    for ctx in range(101, 105):
        t += MODEL.step_seconds(StepShape(decode_contexts=(ctx,)))
        want.append(t)
    assert rec.chunk_times == pytest.approx(want, abs=1e-9)


def test_simulation_is_deterministic() -> None:
    trace = synthetic_trace(num_requests=30, rate=50.0, input_len=100, output_len=10, block_tokens=64, seed=5)
    a = simulate(trace, factory(), vocab_size=SPEC.vocab_size, block_tokens=64)
    b = simulate(trace, factory(), vocab_size=SPEC.vocab_size, block_tokens=64)
    assert [r.chunk_times for r in a.records] == [r.chunk_times for r in b.records]


def test_an_hour_of_traffic_runs_in_virtual_time() -> None:
    trace = synthetic_trace(duration_s=3600, rate=0.05, input_len=64, output_len=8, block_tokens=64, seed=1)
    res = simulate(trace, factory(), vocab_size=SPEC.vocab_size, block_tokens=64)
    assert res.virtual_s >= 3500 and len(res.records) == len(trace)
    assert res.wall_s < res.virtual_s / 10  # generous: it is seconds, not an hour


class ZeroCost:
    def step_seconds(self, shape: StepShape) -> float:
        return 0.0


def test_virtual_time_moves_even_when_steps_take_no_time() -> None:
    res = simulate([TraceRequest(0, 10, 6)], factory(perf=ZeroCost()), vocab_size=SPEC.vocab_size)
    (rec,) = res.records
    assert res.num_idle_steps == res.num_steps == 6
    assert rec.chunk_times == pytest.approx([IDLE_STEP_S * k for k in range(1, 7)])


def test_virtual_time_moves_when_a_step_schedules_nothing() -> None:
    engine = make_mock_engine(EngineConfig(num_kv_blocks=64), spec=SPEC, perf=MODEL)
    schedule = engine.scheduler.schedule
    calls = 0

    def stuck() -> ScheduledBatch:  # has work but schedules nothing for 49 steps (as when nothing fits)
        nonlocal calls
        calls += 1
        return ScheduledBatch() if calls < 50 else schedule()

    engine.scheduler.schedule = stuck  # type: ignore[method-assign]

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            service = await nursery.start(EngineService(lambda: engine, inline=True).run)
            t0 = trio.current_time()
            with service.submit([5], SamplingParams(max_tokens=1)) as handle:
                await handle.receive()
            elapsed = trio.current_time() - t0
            nursery.cancel_scope.cancel()
        return elapsed

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    prefill = MODEL.step_seconds(StepShape(prefill_chunks=((1, 0),)))
    assert calls == 50 and elapsed == pytest.approx(49 * IDLE_STEP_S + prefill)


def test_client_disconnect_frees_every_block() -> None:
    def used_blocks(service: EngineService) -> int:
        engine = service.statistics().engine
        assert engine is not None
        return engine.num_blocks_used

    async def main() -> tuple[int, int]:
        service = EngineService(factory(), inline=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            handles = [service.submit(list(range(3, 3 + 50 + i)), SamplingParams(max_tokens=100, ignore_eos=True))
                       for i in range(6)]
            for h in handles:
                await h.receive()
            used_mid = used_blocks(service)
            for h in handles:
                h.close()  # what the HTTP layer does when the client goes away
            await trio.sleep(1)
            used_end = used_blocks(service)
            st = service.statistics()
            assert st.engine is not None and st.engine.num_running == st.engine.num_waiting == 0
            assert st.num_live_requests == 0
            nursery.cancel_scope.cancel()
        return used_mid, used_end

    used_mid, used_end = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert used_mid > 0 and used_end == 0
