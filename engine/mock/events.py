"""KV events and per-step load metrics, from any LLMEngine (mock or real), for a KV-aware router.

`EngineObserver` hooks the engine's BlockManager (its `on_kv_event`) and wraps `step`: after each step it
records one `StepReport` (load metrics plus the KV events of that step, each with a monotonically increasing
event id) in a bounded, thread-safe deque. The web side drains it and fans it out on a websocket
(web/kv_events.py). Emission follows Dynamo's mocker: "stored" when a full block enters the prefix cache,
"removed" when one is evicted from it (not when its last reference goes: a free block stays matchable).
A consumer that sees a gap in event ids has missed events and must resync.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class KVEvent:
    event_id: int
    kind: str  # "stored" | "removed"
    block_hash: str  # hex of the chained 16-byte block hash
    parent_hash: str | None = None  # stored only: the previous block's hash (None for a first block)


@dataclass(frozen=True, slots=True)
class StepLoad:
    step: int
    time: float  # time.time() when the step ended
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int
    step_s: float  # the step's duration (the mock's predicted one, or measured)


@dataclass(frozen=True, slots=True)
class StepReport:
    load: StepLoad
    kv_events: tuple[KVEvent, ...]

    def to_json(self) -> dict[str, Any]:
        return {"load": asdict(self.load), "kv_events": [asdict(e) for e in self.kv_events]}


class _Engine(Protocol):
    block_manager: Any
    scheduler: Any

    def step(self, *, check_abort: Callable[[], None] | None = None) -> list[Any]: ...


class EngineObserver:
    """Wraps an engine: same interface, plus `reports` (the latest `maxlen` StepReports).

    Everything but `drain` runs on the engine's thread; deque append/popleft are atomic, so `drain` may run
    on another thread.
    """

    def __init__(self, engine: _Engine, *, maxlen: int = 4096, step_seconds: Callable[[], float] | None = None) -> None:
        self._engine = engine
        self._ids = itertools.count(1)
        self._pending: list[KVEvent] = []
        self._step = 0
        self._step_seconds = step_seconds
        self.reports: deque[StepReport] = deque(maxlen=maxlen)
        engine.block_manager.on_kv_event = self._on_kv_event

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _on_kv_event(self, kind: str, h: bytes, parent: bytes | None) -> None:
        self._pending.append(KVEvent(next(self._ids), kind, h.hex(), parent.hex() if parent is not None else None))

    def step(self, *, check_abort: Callable[[], None] | None = None) -> list[Any]:
        t0 = time.perf_counter()
        outputs = self._engine.step(check_abort=check_abort)
        elapsed = self._step_seconds() if self._step_seconds is not None else time.perf_counter() - t0
        self._step += 1
        bm, sch = self._engine.block_manager, self._engine.scheduler
        load = StepLoad(self._step, time.time(), len(sch.running), len(sch.waiting), bm.num_used_blocks,
                        bm.num_usable_blocks, elapsed)
        events, self._pending = tuple(self._pending), []
        self.reports.append(StepReport(load, events))
        return outputs

    def drain(self) -> list[StepReport]:
        out = []
        while True:
            try:
                out.append(self.reports.popleft())
            except IndexError:
                return out
