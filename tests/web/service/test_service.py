"""EngineService around the mock engine: fan-out, coalescing, aborts, failures, cancellation."""

from __future__ import annotations

import time

import pytest
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest, Overloaded
from trillm.engine.outputs import EngineStatistics
from trillm.engine.sampling_params import SamplingParams
from trillm.web.service.engine_service import EngineService, EngineUnavailable, ServiceState
from trillm.web.service.stream import GenerationFailed, GenerationHandle

from conftest import SPEC, MockFactory, reference_text, running_service
from trillm.engine.mock import MockModelSpec

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def engine_stats(service: EngineService) -> EngineStatistics:
    stats = service.statistics().engine
    assert stats is not None
    return stats


async def collect(handle: GenerationHandle) -> dict[str, str]:
    texts: dict[str, str] = {rid: "" for rid in handle.request_ids}
    while True:
        try:
            out = await handle.receive()
        except trio.EndOfChannel:
            return texts
        texts[out.request_id] += out.new_text


async def test_greedy_text_matches_reference() -> None:
    async with running_service(MockFactory()) as service:
        prompt = [10, 20, 30]
        with service.submit(prompt, GREEDY) as handle:
            texts = await collect(handle)
        assert list(texts.values()) == [reference_text(prompt, 12)]


async def test_concurrent_streams_equal_sequential() -> None:
    async with running_service(MockFactory(step_delay=0.001)) as service:
        prompts = [[i + 5, 2 * i + 7] for i in range(32)]
        sequential = []
        for p in prompts:
            with service.submit(p, GREEDY) as h:
                sequential.append((await collect(h)).popitem()[1])
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            with service.submit(prompts[i], GREEDY) as h:
                results[i] = (await collect(h)).popitem()[1]

        async with trio.open_nursery() as nursery:
            for i in range(32):
                nursery.start_soon(one, i)
        assert [results[i] for i in range(32)] == sequential
        assert sequential == [reference_text(p, 12) for p in prompts]
        assert service.statistics().num_steps < 32 * 13  # they really were batched


async def test_n_choices_arrive_separately() -> None:
    async with running_service(MockFactory()) as service:
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3)]
        with service.submit([5, 6, 7], params) as h:
            texts = await collect(h)
        assert len(texts) == 3 and all(t == reference_text([5, 6, 7], 8, seed=s) for s, t in zip((1, 2, 3), texts.values()))
        assert len(set(texts.values())) > 1


async def test_abort_frees_blocks_at_next_step() -> None:
    factory = MockFactory(step_delay=0.005)
    async with running_service(factory) as service:
        handle = service.submit([5] * 40, SamplingParams(max_tokens=1000, temperature=0.0))
        await handle.receive()
        assert engine_stats(service).num_blocks_used > 0
        handle.close()
        t0 = time.perf_counter()
        while engine_stats(service).num_blocks_used or engine_stats(service).num_running:
            assert time.perf_counter() - t0 < 1.0
            await trio.sleep(0.005)


async def test_slow_consumer_gets_coalesced_text() -> None:
    async with running_service(MockFactory(), channel_size=2) as service:
        prompt = [9, 9]
        with service.submit(prompt, SamplingParams(max_tokens=50, temperature=0.0)) as handle:
            while service.statistics().num_live_requests:
                await trio.sleep(0.01)  # do not read until the engine finished the request
            deltas = []
            while True:
                try:
                    deltas.append(await handle.receive())
                except trio.EndOfChannel:
                    break
        assert "".join(d.new_text for d in deltas) == reference_text(prompt, 50)
        assert len(deltas) == 3  # two buffered, the rest merged into one
        assert deltas[-1].finished and deltas[-1].usage.completion_tokens == 50
        assert sum(len(d.new_token_ids) for d in deltas) == 50


async def test_buffered_bytes_cap_aborts_with_clear_error() -> None:
    async with running_service(MockFactory(), channel_size=2, max_buffered_bytes=20) as service:
        handle = service.submit([3, 4], SamplingParams(max_tokens=500, temperature=0.0))
        with trio.fail_after(5):
            while not handle._closed:
                await trio.sleep(0.01)
        with pytest.raises(GenerationFailed, match="too slowly"):
            await handle.receive()
        await trio.sleep(0.05)
        assert engine_stats(service).num_running == 0


async def test_admission_is_decided_at_submit() -> None:
    cfg = EngineConfig(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64, max_waiting=1)
    spec = MockModelSpec(name="small", vocab_size=SPEC.vocab_size, max_model_len=100)
    async with running_service(MockFactory(config=cfg, spec=spec, step_delay=0.01)) as service:
        with pytest.raises(InvalidRequest, match="context length"):
            service.submit([5] * 100, GREEDY)
        long = SamplingParams(max_tokens=90, temperature=0.0)
        handles = [service.submit([5, 6], long)]
        with pytest.raises(Overloaded):  # the queue holds one, and the first is still queued
            service.submit([5, 6], long)
        for running in (1, 2):
            with trio.fail_after(2):
                while engine_stats(service).num_running < running:
                    await trio.sleep(0.005)
            handles.append(service.submit([5, 6], long))
        with pytest.raises(Overloaded):  # two run (max_num_seqs), one waits
            service.submit([5, 6], long)
        for h in handles:
            h.close()


async def test_engine_failure_fails_every_stream_then_restarts() -> None:
    factory = MockFactory(step_delay=0.002)
    async with running_service(factory, restart_backoff_s=0.05) as service:
        handles = [service.submit([i + 3], SamplingParams(max_tokens=500)) for i in range(5)]
        for h in handles:
            await h.receive()
        factory.fail_next_step()
        with trio.fail_after(2):
            for h in handles:
                with pytest.raises(GenerationFailed, match="the engine failed while serving this request"):
                    while True:
                        await h.receive()
        assert "injected engine failure" in (service.last_error or "")  # logged and kept, never sent
        assert service.state is ServiceState.UNHEALTHY
        with trio.fail_after(2):
            while service.state is not ServiceState.READY:
                await trio.sleep(0.01)
        assert len(factory.engines) == 2 and service.num_restarts == 1
        with service.submit([7], GREEDY) as h:
            assert (await collect(h)).popitem()[1] == reference_text([7], 12)
        assert service.metrics.outcomes["error"] == 5


async def test_cancel_interrupts_a_long_prefill() -> None:
    cfg = EngineConfig(num_kv_blocks=4096, max_num_seqs=4, max_num_batched_tokens=4)
    spec = MockModelSpec(name="long", vocab_size=SPEC.vocab_size, max_model_len=100_000)
    factory = MockFactory(config=cfg, step_delay=0.01, spec=spec)
    t0 = 0.0
    async with running_service(factory) as service:
        service.submit([5] * 20_000, GREEDY)  # ~50 s of prefill at 4 tokens per 10 ms step
        await trio.sleep(0.05)
        t0 = time.perf_counter()
    assert time.perf_counter() - t0 < 0.5


async def test_lazy_load_then_unload_after_idle_then_reload() -> None:
    factory = MockFactory()
    async with running_service(factory, lazy_load=True, unload_after_idle_s=0.1) as service:
        assert service.state is ServiceState.UNLOADED and service.healthy and factory.engines == []
        for expected_engines in (1, 2):
            await service.ensure_loaded()
            with service.submit([4], GREEDY) as h:
                assert (await collect(h)).popitem()[1] == reference_text([4], 12)
            assert len(factory.engines) == expected_engines
            with trio.fail_after(2):
                while service.state is not ServiceState.UNLOADED:
                    await trio.sleep(0.02)


async def test_a_declared_failure_fails_every_stream_at_once_then_restarts() -> None:
    """`fail` (a watchdog's call) ends the streams and turns the model unhealthy without waiting for the
    engine's next step; the engine raises at its next hop, busy or idle, and restarts as after any failure."""
    factory = MockFactory(step_delay=0.002)
    async with running_service(factory, restart_backoff_s=0.05) as service:
        handles = [service.submit([i + 3], SamplingParams(max_tokens=500)) for i in range(3)]
        for h in handles:
            await h.receive()
        service.fail(RuntimeError("rank 1 is gone"))
        assert service.state is ServiceState.UNHEALTHY and "rank 1 is gone" in (service.last_error or "")
        with pytest.raises(EngineUnavailable):
            service.submit([5], GREEDY)
        for h in handles:
            with trio.fail_after(0.5), pytest.raises(GenerationFailed, match="the engine failed"):
                while True:
                    await h.receive()
        for engines in (2, 3):
            with trio.fail_after(2):
                while service.state is not ServiceState.READY:
                    await trio.sleep(0.01)
            assert len(factory.engines) == engines
            await trio.sleep(0.05)  # idle now: parked waiting for work
            service.fail(RuntimeError("again"))
            assert service.state is ServiceState.UNHEALTHY
        with trio.fail_after(2):
            while service.state is not ServiceState.READY:
                await trio.sleep(0.01)
        with service.submit([7], GREEDY) as h:
            assert (await collect(h)).popitem()[1] == reference_text([7], 12)
