"""EngineService's lifecycle on trio's MockClock (the inline shell, as `trillm simulate` runs it): the restart
backoff resets once an engine has been stable, a request that only one engine call refuses fails alone, and a
submission landing in the very tick the idle unload fires is still served."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trillm.engine.config import EngineConfig
from trillm.engine.driver import EngineDriver, Submit
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.mock import make_mock_engine
from trillm.engine.sampling_params import SamplingParams
from trillm.web.service.engine_service import EngineService, ServiceConfig, ServiceState
from trillm.web.service.stream import GenerationHandle

from conftest import DEFAULT_CONFIG, SPEC

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class InlineFactory:
    """Mock engines whose step time passes on trio's clock (no sleeping thread)."""

    def __init__(self, config: EngineConfig = DEFAULT_CONFIG) -> None:
        self.config = config
        self.engines: list[LLMEngine] = []

    def __call__(self) -> LLMEngine:
        engine = make_mock_engine(self.config, spec=SPEC)
        self.engines.append(engine)
        return engine

    def fail_next_step(self) -> None:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected")

        self.engines[-1].runner.launch = broken  # type: ignore[method-assign]


async def finish(handle: GenerationHandle) -> int:
    tokens = 0
    with handle:
        while True:
            try:
                tokens += len((await handle.receive()).new_token_ids)
            except trio.EndOfChannel:
                return tokens


async def wait_ready(service: EngineService) -> float:
    t0 = trio.current_time()
    while service.state is not ServiceState.READY:
        await trio.sleep(0.001)
    return trio.current_time() - t0


async def fail_once(factory: InlineFactory, service: EngineService) -> float:
    """Fail the live engine's next step; the time from the failure until the new engine is ready."""
    factory.fail_next_step()
    handle = service.submit([5, 6], PARAMS)
    with pytest.raises(Exception):
        await finish(handle)
    return await wait_ready(service)


async def test_the_restart_backoff_resets_once_an_engine_was_stable(autojump_clock: trio.testing.MockClock) -> None:
    factory = InlineFactory()
    config = ServiceConfig(restart_backoff_s=1.0, max_restart_backoff_s=64.0, stable_after_s=30.0)
    async with trio.open_nursery() as nursery:
        service = await nursery.start(EngineService(factory, config=config, inline=True).run)
        waits = [await fail_once(factory, service) for _ in range(3)]  # back to back: 1, 2, 4 s
        await trio.sleep(31)  # the fourth engine runs longer than stable_after_s
        waits.append(await fail_once(factory, service))
        nursery.cancel_scope.cancel()
    assert [round(w) for w in waits] == [1, 2, 4, 1], waits


async def test_an_unexpected_error_adding_one_request_fails_only_it() -> None:
    engine = make_mock_engine(DEFAULT_CONFIG, spec=SPEC)
    add = engine.scheduler.add

    def add_or_explode(seq: Any) -> None:
        if seq.request_id == "bad":
            raise TypeError("a bug in setting up this one request")
        add(seq)

    engine.scheduler.add = add_or_explode  # type: ignore[method-assign]
    driver = EngineDriver(engine)
    result = driver.run_once([Submit("good", [5, 6], PARAMS), Submit("bad", [7, 8], PARAMS)])
    assert [r.request_id for r in result.rejected] == ["bad"] and isinstance(result.rejected[0].error, TypeError)
    outputs = list(result.outputs)
    while engine.has_unfinished_requests():
        outputs += driver.run_once([]).outputs
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "good") == 4
    assert engine.statistics().num_blocks_used == 0


async def test_a_submission_in_the_tick_the_idle_unload_fires_is_served(
        autojump_clock: trio.testing.MockClock) -> None:
    factory = InlineFactory()
    config = ServiceConfig(unload_after_idle_s=1.0)
    assert config.unload_after_idle_s is not None
    async with trio.open_nursery() as nursery:
        service = await nursery.start(EngineService(factory, config=config, inline=True).run)
        for attempt in range(40):
            await service.ensure_loaded()
            assert await finish(service.submit([5, attempt], PARAMS)) == 4
            # The engine went idle in this very tick: submit exactly when its idle deadline fires.
            await trio.sleep_until(trio.current_time() + config.unload_after_idle_s)
            if service.state is not ServiceState.READY:
                continue  # it unloaded a hair earlier: nothing to race with this time
            handle = service.submit([6, attempt], PARAMS)
            with trio.fail_after(10):
                assert await finish(handle) == 4
        nursery.cancel_scope.cancel()
