"""EngineDriver: one engine's step loop as a synchronous core, for thin shells to drive.

A shell (web/service.py: on a dedicated thread for the real engine, or inline in a trio task for the mock on
a real or virtual clock) only moves work in and results out: each `run_once(work)` applies the submissions
and aborts, runs one engine step if anything is live, and returns everything the outside needs from that
step: the per-request deltas, the requests added and those refused while being added (a verdict the web
layer waits for before a stream's headers), the engine's statistics, the step's KV events and load, and how
long the step took. The driver never blocks and never sleeps.

Concurrency: confined to the thread that created the engine (MLX streams are per thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trillm.engine.errors import EngineError, UnknownRequest
from trillm.engine.kv_events import KVEventLog, StepLoad, StepReport
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.outputs import EngineStatistics, RequestOutput
from trillm.engine.sampling_params import SamplingParams

log = logging.getLogger("trillm.engine.driver")


@dataclass(frozen=True, slots=True)
class Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    group: str | None = None  # the client request it belongs to (fair admission between requests)


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


Work = Submit | Abort


@dataclass(frozen=True, slots=True)
class Rejected:
    """A submission the engine refused while adding it; only that request fails."""

    request_id: str
    error: Exception  # EngineError (InvalidRequest, Overloaded) on purpose; anything else is a bug


@dataclass(frozen=True, slots=True)
class StepResult:
    outputs: list[RequestOutput]
    rejected: list[Rejected]
    statistics: EngineStatistics
    report: StepReport | None  # None when no step ran
    step_s: float  # how long the step takes: the mock's simulated duration, or the measured wall time
    ran: bool  # whether the engine ran a step (False: idle, or a step that scheduled nothing)
    prefilling: tuple[str, ...] = ()  # request ids with a prefill chunk in the step (a request's first: its queue ended)
    added: tuple[str, ...] = ()  # request ids the engine took in this call (the others of `work` are in `rejected`)


class EngineDriver:
    def __init__(self, engine: LLMEngine, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self._events = KVEventLog(engine.block_manager)
        self._wall_clock = wall_clock
        self.num_steps = 0

    @property
    def idle(self) -> bool:
        return not self.engine.has_unfinished_requests()

    @property
    def release_after_s(self) -> float | None:
        """How long an idle shell may park before calling `run_once([])` to shrink the KV pool (None: forever)."""
        return self.engine.idle_release_in

    def run_once(self, work: Sequence[Work], *, check_abort: Callable[[], None] | None = None) -> StepResult:
        """Apply `work`, then one engine step if anything is live. check_abort may raise to stop mid-step."""
        added, rejected = self._apply(work)
        if not work and self.engine.idle_release_in == 0.0:
            self.engine.release_idle_memory()
        outputs: list[RequestOutput] = []
        report = None
        step_s = 0.0
        ran = False
        prefilling: tuple[str, ...] = ()
        if self.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = self.engine.step(check_abort=check_abort)
            wall = time.perf_counter() - t0
            info = self.engine.last_step
            ran = info is not None
            prefilling = tuple(c.seq.request_id for c in info.batch.prefills) if info is not None else ()
            step_s = info.virtual_seconds if info is not None and info.virtual_seconds is not None else wall
        stats = self.engine.statistics()
        if ran:
            self.num_steps += 1
            load = StepLoad(self.num_steps, self._wall_clock(), stats.num_running, stats.num_waiting,
                            stats.num_blocks_used, stats.num_blocks_total, step_s)
            report = StepReport(load, self._events.take())
        return StepResult(outputs, rejected, stats, report, step_s, ran, prefilling, added)

    def _apply(self, work: Sequence[Work]) -> tuple[tuple[str, ...], list[Rejected]]:
        added: list[str] = []
        rejected = []
        for item in work:
            if isinstance(item, Abort):
                try:
                    self.engine.abort(item.request_id)
                except UnknownRequest:
                    pass  # it finished, or was refused, before the abort arrived
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, priority=item.priority,
                                        group=item.group)
                added.append(item.request_id)
            except EngineError as exc:
                rejected.append(Rejected(item.request_id, exc))
            except Exception as exc:  # a bug in setting up one request must not take the others down
                log.exception("adding request %s failed", item.request_id)
                rejected.append(Rejected(item.request_id, exc))
        return tuple(added), rejected
