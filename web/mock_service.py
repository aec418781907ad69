"""An EngineService whose engine steps in a trio task, so a step's time passes as `await trio.sleep(d)`.

"Two clocks, the same code": the mock server (`trillm serve --mock`) and the simulator (`trillm simulate`)
both run this service around the same LLMEngine + MockRunner; the server on trio's real clock (durations
divided by --speedup), the simulator on `trio.testing.MockClock(autojump_threshold=0)`, where the sleep ends
the moment every task is blocked, so an hour of traffic takes as long as the Python work in it.

It reuses EngineService's trio-side hops (admissions, deltas, aborts, handles) unchanged and replaces only the
engine thread. Engine steps run on the trio thread: fine for the mock, whose steps do no model work.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from trillm.web.service import Engine, EngineService, ServiceConfig, _apply

IDLE_STEP_S = 1e-3  # time a step that scheduled nothing still takes, so virtual time always advances
# LLMEngine.statistics() walks the free-block list and the rate window (O(blocks + steps)); at thousands of
# steps per second that dominates, so it is refreshed at most this often (and whenever the engine goes idle).
STATS_INTERVAL_S = 0.1


def runner_step_seconds(engine: Engine) -> Callable[[], float]:
    """Read (and reset) the duration of the engine's latest MockRunner step: 0.0 means the runner was skipped."""
    runner = engine.runner  # type: ignore[attr-defined]

    def take() -> float:
        d, runner.last_step_s = runner.last_step_s, 0.0
        return d

    return take


class InlineEngineService(EngineService):
    """EngineService for an engine that does no real work per step (the mock): the step loop is a trio task."""

    def __init__(self, engine_factory: Callable[[], Engine], *, name: str | None = None,
                 config: ServiceConfig = ServiceConfig(), idle_step_s: float = IDLE_STEP_S,
                 on_step: Callable[[Engine], None] | None = None, stats_interval_s: float = STATS_INTERVAL_S,
                 stats_when_idle: bool = True) -> None:
        super().__init__(engine_factory, name=name, config=config)
        self._idle_step_s = idle_step_s
        self._on_step_hook = on_step
        self._stats_interval_s = stats_interval_s
        self._stats_when_idle = stats_when_idle
        self.engine: Engine | None = None
        self.num_steps = 0
        self.num_idle_steps = 0

    async def run(self, *, task_status: trio.TaskStatus[EngineService] = trio.TASK_STATUS_IGNORED) -> None:
        self._started = task_status
        engine = self.engine = self._factory()
        step_seconds = runner_step_seconds(engine)
        work = self._on_engine_started(engine)
        stats_at = -float("inf")
        while True:
            if not work and not engine.has_unfinished_requests():
                work = await self._wait_for_work()
            admissions = _apply(engine, work)
            if admissions:
                self._on_admissions(admissions)
            outputs = []
            if engine.has_unfinished_requests():
                step_seconds()
                outputs = engine.step()
                d = step_seconds()
                self.num_steps += 1
                if d <= 0.0:  # nothing was scheduled: still let time pass, or a virtual clock would spin
                    self.num_idle_steps += 1
                    d = self._idle_step_s
                if self._on_step_hook is not None:
                    self._on_step_hook(engine)
                await trio.sleep(d)  # the step's tokens exist only once its time has passed
            else:
                await trio.sleep(0)
            stats = self._stats
            idle = self._stats_when_idle and not engine.has_unfinished_requests()
            if stats is None or idle or trio.current_time() >= stats_at + self._stats_interval_s:
                stats, stats_at = engine.statistics(), trio.current_time()
            work = self._on_step(outputs, stats)
