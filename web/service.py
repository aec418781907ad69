"""EngineService: one model's engine on one long-lived thread, driven from trio.

Concurrency invariants (trio style):
- The engine is created and used only on its own thread (`_engine_thread`), because MLX streams are bound
  to the thread that made them. That thread never touches trio-side state directly.
- Everything else here (the inbox, the live-request map, handles, metrics) is touched only on the trio
  thread. The engine thread reaches it through `trio.from_thread`: one hop per engine step delivers every
  request's delta and, in the same hop, takes the new submissions and aborts. When the engine is idle the
  thread parks in `trio.from_thread.run(self._wait_for_work)`, which a submission or abort wakes.
- `EngineService.run` owns the thread: it restarts the engine after a failure, and cancelling it stops the
  thread at its next hop or prefill chunk (`check_cancelled`).
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from trillm.engine.errors import EngineError, InvalidRequest, Overloaded, UnknownRequest
from trillm.engine.outputs import EngineStatistics, RequestOutput
from trillm.engine.sampling_params import SamplingParams
from trillm.web.metrics import ModelMetrics
from trillm.web.stream import GenerationHandle

log = logging.getLogger("trillm.web.service")

# engine.statistics() is cheap (O(1)) but builds a record per call, so it is refreshed at most this often while
# busy (and always when the engine goes idle, so freed KV blocks show at once).
STATS_INTERVAL_S = 0.05


class EngineUnavailable(EngineError):
    """The model is loading or restarting after a failure; retry shortly. HTTP 503."""


class Tokenizer(Protocol):
    """The part of `trillm.engine.tokenizer.Tokenizer` the web layer uses."""

    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]: ...
    def token_bytes(self, token_id: int) -> bytes: ...


class Engine(Protocol):
    """The part of `trillm.engine.llm_engine.LLMEngine` the service uses."""

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def model_name(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self, *, check_abort: Callable[[], None] | None = None) -> list[RequestOutput]: ...
    def statistics(self) -> EngineStatistics: ...


class ServiceState(enum.Enum):
    UNLOADED = "unloaded"  # lazy, or unloaded after idling: the next request loads it
    LOADING = "loading"
    READY = "ready"
    UNHEALTHY = "unhealthy"  # failed; restarting


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Knobs of one EngineService."""

    channel_size: int = 64  # deltas buffered per submission before coalescing starts
    max_buffered_bytes: int = 4 << 20  # text buffered for a slow client before its request is aborted
    restart_backoff_s: float = 0.5  # first wait before restarting a failed engine; doubles up to 30 s
    max_restart_backoff_s: float = 30.0
    lazy_load: bool = False  # load on the first request instead of at start-up
    unload_after_idle_s: float | None = None  # free the model after this long without requests

    def __post_init__(self) -> None:
        if self.channel_size < 1 or self.max_buffered_bytes < 1:
            raise ValueError("channel_size and max_buffered_bytes must be >= 1")
        if self.unload_after_idle_s is not None and self.unload_after_idle_s <= 0:
            raise ValueError("unload_after_idle_s must be > 0")


@dataclass(frozen=True, slots=True)
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class EngineService:
    """Serves one model: `submit` requests from any trio task; `run` must be running in a nursery."""

    def __init__(self, engine_factory: Callable[[], Engine], *, name: str | None = None,
                 config: ServiceConfig = ServiceConfig()) -> None:
        self._factory = engine_factory
        self._config = config
        self._served_name = name
        self.model_name = name or "loading"
        self._state = ServiceState.LOADING
        self._state_changed = trio.Event()
        self._load_wanted = trio.Event()
        self.last_error: str | None = None
        self.metrics = ModelMetrics()
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self._stats: EngineStatistics | None = None
        self._inbox: list[_Submit | _Abort] = []
        self._wakeup = trio.Event()
        self._live: dict[str, GenerationHandle] = {}
        self._ids = itertools.count()
        self._num_restarts = 0
        self._started: trio.TaskStatus[EngineService] | None = None

    # ---- lifecycle (trio thread) ----

    @property
    def state(self) -> ServiceState:
        return self._state

    @state.setter
    def state(self, value: ServiceState) -> None:
        self._state = value
        self._state_changed.set()
        self._state_changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[EngineService] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine thread until cancelled, restarting it after failures.

        Reports readiness (the loaded service) through `task_status`. A failure to load the model the first
        time propagates; later failures restart the engine with exponential backoff. With `lazy_load` it
        reports at once and loads on the first request; with `unload_after_idle_s` the thread ends (freeing
        the model) after that long idle, and the next request loads it again.
        """
        self._started = task_status
        if self._config.lazy_load:
            self.state = ServiceState.UNLOADED
            self._report_started()
        backoff = self._config.restart_backoff_s
        failed = False
        while True:
            if self.state is ServiceState.UNLOADED:
                await self._load_wanted.wait()
                self._load_wanted = trio.Event()
            self.state = ServiceState.UNHEALTHY if failed else ServiceState.LOADING
            try:
                # Its own limiter: the long-lived engine thread never holds one of trio's shared 40 tokens.
                await trio.to_thread.run_sync(self._engine_thread, thread_name=f"trillm-engine-{self.model_name}",
                                              limiter=trio.CapacityLimiter(1))
            except Exception as exc:
                if self._started is not None:  # never came up: the caller gets the load error
                    raise
                self._on_engine_failure(exc)
                failed = True
            else:  # unloaded after idling (the thread set UNLOADED)
                log.info("unloaded %s after %s s idle", self.model_name, self._config.unload_after_idle_s)
                failed, backoff = False, self._config.restart_backoff_s
                continue
            await trio.sleep(backoff)
            backoff = min(backoff * 2, self._config.max_restart_backoff_s)
            self._num_restarts += 1
            log.warning("restarting the engine of %s (restart %d)", self.model_name, self._num_restarts)

    async def ensure_loaded(self) -> None:
        """Wait until the model is ready, loading it first if it is unloaded (lazy or idle)."""
        while self.state is not ServiceState.READY:
            if self.state is ServiceState.UNHEALTHY:
                raise EngineUnavailable(f"model {self.model_name} is {self.state.value}; retry shortly")
            if self.state is ServiceState.UNLOADED:
                self._load_wanted.set()
            await self._state_changed.wait()

    def _report_started(self) -> None:
        if self._started is not None:
            started, self._started = self._started, None
            started.started(self)

    def _on_engine_failure(self, exc: BaseException) -> None:
        message = f"the engine failed: {type(exc).__name__}: {exc}"
        log.error("model %s: %s", self.model_name, message, exc_info=exc)
        self.state = ServiceState.UNHEALTHY
        self.last_error = message
        self._fail_all(message)

    def _fail_all(self, message: str) -> None:
        live, self._live = self._live, {}
        self._inbox.clear()  # the new engine starts empty: queued submissions and aborts are void
        for handle in {id(h): h for h in live.values()}.values():
            handle.fail(message)

    @property
    def healthy(self) -> bool:
        """Ready, or unloaded on purpose (the next request loads it)."""
        return self.state in (ServiceState.READY, ServiceState.UNLOADED)

    @property
    def num_restarts(self) -> int:
        return self._num_restarts

    def statistics(self) -> EngineStatistics | None:
        """The engine's statistics as of its latest step (None before the first)."""
        return self._stats

    # ---- requests (trio thread) ----

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | list[SamplingParams],
               *, priority: int = 0) -> GenerationHandle:
        """Queue one prompt for n = len(params) generations; the caller must `close()` the handle.

        Raises EngineUnavailable while the model loads or restarts. The engine's own refusals
        (InvalidRequest, Overloaded) arrive from `handle.wait_admitted()`.
        """
        if self.state is not ServiceState.READY:
            raise EngineUnavailable(f"model {self.model_name} is {self.state.value}; retry shortly")
        all_params = params if isinstance(params, list) else [params]
        rids = tuple(f"req-{next(self._ids)}" for _ in all_params)
        handle = GenerationHandle(rids, abort=self._abort, channel_size=self._config.channel_size,
                                  max_buffered_bytes=self._config.max_buffered_bytes, metrics=self.metrics)
        for rid, p in zip(rids, all_params):
            self._live[rid] = handle
            self._inbox.append(_Submit(rid, list(prompt_token_ids), p, priority))
        self._wakeup.set()
        return handle

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self._inbox.append(_Abort(request_id))
            self._wakeup.set()

    # ---- hops from the engine thread (run on the trio thread) ----

    def _on_engine_started(self, engine: Engine) -> list[_Submit | _Abort]:
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_name = self._served_name or engine.model_name
        self.state = ServiceState.READY
        self.last_error = None
        self._report_started()
        return self._take_work()

    def _take_work(self) -> list[_Submit | _Abort]:
        work, self._inbox = self._inbox, []
        self._wakeup = trio.Event()
        return work

    async def _wait_for_work(self) -> list[_Submit | _Abort]:
        while not self._inbox:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        return self._take_work()

    async def _wait_for_work_or_idle(self) -> list[_Submit | _Abort] | None:
        """Like `_wait_for_work`, but None (and UNLOADED) after `unload_after_idle_s` without work."""
        timeout = self._config.unload_after_idle_s
        with trio.move_on_after(math.inf if timeout is None else timeout):
            return await self._wait_for_work()
        self.state = ServiceState.UNLOADED  # from now on a request waits for a reload (ensure_loaded)
        return None

    def _on_admissions(self, results: list[tuple[str, EngineError | None]]) -> None:
        for rid, error in results:
            handle = self._live.get(rid)
            if handle is None:
                continue
            if error is not None:
                del self._live[rid]
            handle.on_admitted(rid, error)

    def _on_step(self, outputs: list[RequestOutput], stats: EngineStatistics | None) -> list[_Submit | _Abort]:
        if stats is not None:  # None: unchanged since the last refresh (see STATS_INTERVAL_S)
            self._stats = stats
        for out in outputs:
            handle = self._live.get(out.request_id)
            if handle is None:
                continue  # aborted meanwhile: its abort is in the inbox
            if out.finished:
                del self._live[out.request_id]
            handle.feed(out)
        return self._take_work()

    # ---- the engine thread ----

    def _engine_thread(self) -> None:
        engine = self._factory()  # here, so its MLX streams belong to this thread
        work = trio.from_thread.run_sync(self._on_engine_started, engine)
        stats_at = -float("inf")
        while True:
            trio.from_thread.check_cancelled()
            if not work and not engine.has_unfinished_requests():
                idle_work = trio.from_thread.run(self._wait_for_work_or_idle)
                if idle_work is None:
                    return  # unload: dropping the engine frees the model and its KV cache
                work = idle_work
            admissions = _apply(engine, work)
            if admissions:
                trio.from_thread.run_sync(self._on_admissions, admissions)
            outputs: list[RequestOutput] = []
            if engine.has_unfinished_requests():
                outputs = engine.step(check_abort=trio.from_thread.check_cancelled)
            stats = None
            now = time.monotonic()
            if now - stats_at >= STATS_INTERVAL_S or not engine.has_unfinished_requests():
                stats, stats_at = engine.statistics(), now
            work = trio.from_thread.run_sync(self._on_step, outputs, stats)


def _apply(engine: Engine, work: list[_Submit | _Abort]) -> list[tuple[str, EngineError | None]]:
    """Hand the inbox to the engine (engine thread). Returns each submission's admission result."""
    results: list[tuple[str, EngineError | None]] = []
    for item in work:
        if isinstance(item, _Abort):
            try:
                engine.abort(item.request_id)
            except UnknownRequest:
                pass  # it finished, or was refused, before the abort arrived
            continue
        try:
            engine.add_request(item.request_id, item.prompt_token_ids, item.params, priority=item.priority)
        except (InvalidRequest, Overloaded) as exc:
            results.append((item.request_id, exc))
        else:
            results.append((item.request_id, None))
    return results


def retry_after_seconds(service: EngineService) -> int:
    """A Retry-After hint for a 503: longer while the model (re)loads than when merely overloaded."""
    if service.state is ServiceState.READY:
        return 1
    return max(1, math.ceil(service._config.restart_backoff_s))
