"""EngineService: one model's engine, driven from trio through the engine's synchronous EngineDriver.

Two thin shells run the same driver (engine/driver.py), the way hypercorn keeps one sans-IO protocol inside
thin IO backends:
- threaded (the real engine): the engine lives on one long-lived thread, because MLX streams are bound to
  the thread that made them. Each step is one `trio.from_thread` hop that delivers the step's results and
  takes the new work; when idle the thread parks in `trio.from_thread.run(self._wait_for_work_or_idle)`.
- inline (the mock engine): the driver runs in this trio task and each step's simulated duration passes
  as `await trio.sleep(...)`, on trio's real clock (`serve --mock`) or a virtual one (`trillm simulate`).

Concurrency invariants (trio style): the engine and its driver are touched only by the shell that built
them (the engine thread, or the inline task). Everything else here (the inbox, the live-request map,
handles, metrics, reports) is touched only on the trio thread. `run` owns the shell: it restarts the engine
after a failure, and cancelling it stops the shell at its next hop or prefill chunk (`check_cancelled`).

Lifecycle: a model that cannot be loaded is LOAD_FAILED (requests get a clear 503 with Retry-After, /health
says so) and is tried again after a backoff, never in a tight loop. `drain` (a graceful shutdown) stops
admitting, lets live requests finish for a while, then ends the rest with an error. The engine thread is
abandoned on cancellation (`abandon_on_cancel`; trio's worker threads are daemons) once it had a moment to
stop, so shutting down never waits for a model load to finish.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from trillm.engine.admission import RequestLimits
from trillm.engine.driver import Abort, EngineDriver, StepResult, Submit, Work
from trillm.engine.errors import EngineError, Overloaded
from trillm.engine.kv_events import KVCacheSpec, StepReport
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.model_probe import ProbeResult
from trillm.engine.outputs import EngineStatistics
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.tokenizer import TokenizerLike
from trillm.kernels.selfcheck import KernelReport
from trillm.web.service.metrics import ModelMetrics
from trillm.web.service.stream import GenerationFailed, GenerationHandle
from trillm.web.service.tracing import RequestTrace

log = logging.getLogger("trillm.web.service.engine_service")

EngineFactory = Callable[[], LLMEngine]


class EngineUnavailable(EngineError):
    """The model is loading, restarting after a failure, could not be loaded, or the server is shutting down.

    HTTP 503 with `retry_after_s` as Retry-After; `code` says which (OpenAI's error shape).
    """

    def __init__(self, message: str, *, retry_after_s: float = 1.0, code: str = "model_unavailable") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code


class ServiceState(enum.Enum):
    UNLOADED = "unloaded"  # lazy, or unloaded after idling: the next request loads it
    LOADING = "loading"
    READY = "ready"
    UNHEALTHY = "unhealthy"  # failed; restarting
    LOAD_FAILED = "load_failed"  # the model could not be loaded; tried again after a backoff
    STOPPING = "stopping"  # draining for a shutdown: no new requests


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Knobs of one EngineService."""

    channel_size: int = 64  # deltas buffered per submission before coalescing starts
    max_buffered_bytes: int = 4 << 20  # text buffered for a slow client before its request is aborted
    restart_backoff_s: float = 0.5  # first wait before restarting a failed engine; doubles up to the max
    max_restart_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # an engine that ran this long before failing restarts with the first backoff
    lazy_load: bool = False  # load on the first request instead of at start-up
    unload_after_idle_s: float | None = None  # free the model after this long without requests
    idle_step_s: float = 1e-3  # inline shell: a step that scheduled nothing still lets this much time pass
    max_reports: int = 4096  # step reports kept for the KV-event hub; older ones are dropped (a gap)
    stop_grace_s: float = 2.0  # on cancellation, how long the engine thread may take to stop before it is abandoned

    def __post_init__(self) -> None:
        if self.channel_size < 1 or self.max_buffered_bytes < 1:
            raise ValueError("channel_size and max_buffered_bytes must be >= 1")
        if self.unload_after_idle_s is not None and self.unload_after_idle_s <= 0:
            raise ValueError("unload_after_idle_s must be > 0")


@dataclass(frozen=True, slots=True)
class ServiceStatistics:
    """What is live in one service right now (trio's `statistics()` convention)."""

    state: ServiceState
    num_live_requests: int  # engine requests submitted and not yet finished, refused or aborted
    num_restarts: int
    num_steps: int  # engine steps that ran, over every engine this service has built
    num_idle_steps: int  # inline shell: steps that scheduled nothing
    epoch: int  # incremented each time an engine is (re)built; KV event ids restart with it
    engine: EngineStatistics | None  # as of the latest step (None before the first engine is up)


class EngineService:
    """Serves one model: `submit` requests from any trio task; `run` must be running in a nursery."""

    def __init__(self, engine_factory: EngineFactory, *, name: str | None = None,
                 config: ServiceConfig = ServiceConfig(), inline: bool = False) -> None:
        self._factory = engine_factory
        self._config = config
        self._inline = inline
        self._served_name = name
        self.model_name = name or "loading"
        self._state = ServiceState.LOADING
        self._state_changed = trio.Event()
        self._load_wanted = trio.Event()
        self.last_error: str | None = None
        self.metrics = ModelMetrics()
        self.tokenizer: TokenizerLike | None = None
        self.limits: RequestLimits | None = None
        self.kv_cache_spec: KVCacheSpec | None = None  # the latest engine's block naming, for a KV-aware router
        self._stats: EngineStatistics | None = None
        self.kernel_report: KernelReport | None = None  # the running engine's kernel self-check
        self.model_check: ProbeResult | None = None  # the running engine's load-time check against mlx-lm
        self._inbox: list[Work] = []
        self._unapplied = 0  # submissions in the inbox or in flight: not yet in the engine's waiting count
        self._wakeup = trio.Event()
        self._live: dict[str, GenerationHandle] = {}
        self._deadlines: list[tuple[float, int, GenerationHandle]] = []  # a heap of handles with a deadline
        self._reports: deque[StepReport] = deque(maxlen=config.max_reports)
        self._ids = itertools.count()
        self._num_restarts = 0
        self._num_steps = 0
        self._num_idle_steps = 0
        self._epoch = 0
        self._up_since: float | None = None
        self._started: trio.TaskStatus[EngineService] | None = None
        self._engine_up = False  # the current attempt's engine was built (a failure before that is a load failure)
        self._load_failures = 0  # consecutive failed loads
        self._retry_load_at = 0.0  # trio time of the next load attempt after a failed one
        self._stopping = False  # draining: admit nothing new
        self._stopped = trio.Event()  # run() is over: an engine thread still waiting or loading must quit
        self._drained = trio.Event()  # drain() is done: nothing live is left
        self._emptied = trio.Event()  # set whenever the last live request ends (drain waits on a fresh one)
        self._declared_failure: Exception | None = None  # set by `fail`, raised in the engine's next hop

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len if self.limits is not None else 0

    # ---- lifecycle (trio thread) ----

    @property
    def state(self) -> ServiceState:
        return ServiceState.STOPPING if self._stopping else self._state

    def _set_state(self, value: ServiceState) -> None:
        self._state = value
        self._notify()

    def _notify(self) -> None:
        self._state_changed.set()
        self._state_changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[EngineService] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine until cancelled, restarting it after failures.

        Reports readiness (the loaded service) through `task_status`. A failure to load the model the first
        time propagates; later failures restart the engine with exponential backoff (reset once an engine
        has run for `stable_after_s`). A load that fails later (lazily, or when restarting) leaves the
        service LOAD_FAILED until the backoff has passed; then the next request (lazy) or the backoff itself
        tries again. With `lazy_load` it reports at once and loads on the first request; with
        `unload_after_idle_s` the engine is dropped (freeing the model) after that long idle, and the next
        request loads it again.
        """
        self._started = task_status
        if self._config.lazy_load:
            self._set_state(ServiceState.UNLOADED)
            self._report_started()
        backoff = self._config.restart_backoff_s
        failed = False
        try:
            while True:
                if self._state is ServiceState.LOAD_FAILED:
                    await trio.sleep_until(self._retry_load_at)
                if self._state is ServiceState.UNLOADED or (
                        self._state is ServiceState.LOAD_FAILED and self._config.lazy_load):
                    await self._load_wanted.wait()
                self._load_wanted = trio.Event()
                self._set_state(ServiceState.UNHEALTHY if failed else ServiceState.LOADING)
                self._engine_up = False
                self._take_declared_failure()  # it was about the previous engine
                try:
                    await self._run_shell()
                except Exception as exc:
                    if not self._has_reported_started():  # never came up: the caller gets the load error
                        raise
                    if not self._engine_up:
                        self._on_load_failure(exc)
                        failed = False
                        continue
                    declared = self._take_declared_failure()
                    if declared is None:
                        self._on_engine_failure(exc)
                    else:  # its requests already failed when the failure was declared
                        log.info("model %s: the engine stopped after %s: %s", self.model_name, declared, exc)
                    failed = True
                else:  # unloaded after idling
                    log.info("unloaded %s after %s s idle", self.model_name, self._config.unload_after_idle_s)
                    failed, backoff = False, self._config.restart_backoff_s
                    continue
                if self._up_since is not None and trio.current_time() - self._up_since >= self._config.stable_after_s:
                    backoff = self._config.restart_backoff_s
                self._up_since = None
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self._config.max_restart_backoff_s)
                self._num_restarts += 1
                log.warning("restarting the engine of %s (restart %d)", self.model_name, self._num_restarts)
        finally:
            self._stop()

    def _stop(self) -> None:
        self._stopped.set()
        self._wakeup.set()  # an engine thread waiting for work quits
        self._notify()

    async def _run_shell(self) -> None:
        if self._inline:
            await self._run_inline()
            return
        done = threading.Event()

        def thread() -> None:
            try:
                self._run_threaded()
            finally:
                done.set()

        try:
            # Its own limiter: the long-lived engine thread never holds one of trio's shared 40 tokens.
            # abandon_on_cancel: a cancelled service returns even while the thread is inside a model load.
            await trio.to_thread.run_sync(thread, thread_name=f"trillm-engine-{self.model_name}",
                                          limiter=trio.CapacityLimiter(1), abandon_on_cancel=True)
        except trio.Cancelled:
            # The thread stops at its next check (each step and prefill chunk); give it that moment, so an
            # engine is not torn down mid-step, but never wait for a load to finish.
            self._stop()
            with trio.CancelScope(shield=True), trio.move_on_after(self._config.stop_grace_s):
                while not done.is_set():
                    await trio.sleep(0.005)
            raise

    async def ensure_loaded(self) -> None:
        """Wait until the model is ready, loading it first if it is unloaded (lazy, idle, or failed a while ago)."""
        while (state := self.state) is not ServiceState.READY:
            if state in (ServiceState.STOPPING, ServiceState.UNHEALTHY) or (
                    state is ServiceState.LOAD_FAILED and trio.current_time() < self._retry_load_at):
                raise self.unavailable()
            if state in (ServiceState.LOAD_FAILED, ServiceState.UNLOADED):
                self._load_wanted.set()
            await self._state_changed.wait()

    def _load_failed_error(self) -> EngineUnavailable:
        wait = max(1, math.ceil(self._retry_load_at - trio.current_time()))
        return EngineUnavailable(f"model {self.model_name} could not be loaded (see the server log); the next "
                                 f"attempt is in {wait} s", retry_after_s=wait, code="model_load_failed")

    def unavailable(self) -> EngineUnavailable:
        """Why a request cannot be served right now (the service is not READY)."""
        state = self.state
        if state is ServiceState.LOAD_FAILED:
            return self._load_failed_error()
        if state is ServiceState.STOPPING:
            return EngineUnavailable("the server is shutting down", code="shutting_down")
        what = "restarting after a failure" if state is ServiceState.UNHEALTHY else state.value
        return EngineUnavailable(f"model {self.model_name} is {what}; retry shortly",
                                 retry_after_s=self._config.restart_backoff_s)

    @property
    def next_load_in_s(self) -> float | None:
        """LOAD_FAILED: seconds until the next load attempt may start."""
        if self.state is not ServiceState.LOAD_FAILED:
            return None
        return max(0.0, self._retry_load_at - trio.current_time())

    def _has_reported_started(self) -> bool:
        return self._started is None

    def _report_started(self) -> None:
        if self._started is not None:
            started, self._started = self._started, None
            started.started(self)

    def _on_engine_failure(self, exc: BaseException) -> None:
        message = f"the engine failed: {type(exc).__name__}: {exc}"
        log.error("model %s: %s", self.model_name, message, exc_info=exc)
        self._engine_lost(ServiceState.UNHEALTHY, message,
                          "the engine failed while serving this request; it is restarting")

    def fail(self, exc: Exception) -> None:
        """Declare the running engine failed, from outside it (a watchdog: a tensor-parallel rank died or hangs).

        Every open request fails now and the model turns unhealthy, without waiting for the engine thread:
        it raises `exc` at its next hop into trio, and restarts as after any failure. (An engine blocked
        inside a step cannot be reached from here; unblocking it is the watchdog's job.)
        """
        if self.state is not ServiceState.READY:
            return
        self._declared_failure = exc
        self._on_engine_failure(exc)
        self._wakeup.set()

    def _take_declared_failure(self) -> Exception | None:
        declared, self._declared_failure = self._declared_failure, None
        return declared

    def _raise_declared_failure(self) -> None:
        if self._declared_failure is not None:
            raise self._declared_failure

    def _on_load_failure(self, exc: BaseException) -> None:
        self._load_failures += 1
        wait = min(self._config.restart_backoff_s * 2 ** (self._load_failures - 1), self._config.max_restart_backoff_s)
        self._retry_load_at = trio.current_time() + wait
        message = f"the model could not be loaded: {type(exc).__name__}: {exc}"
        log.error("model %s: %s (attempt %d; the next in %.1f s)", self.model_name, message, self._load_failures,
                  wait, exc_info=exc)
        self._engine_lost(ServiceState.LOAD_FAILED, message, "the model could not be loaded")

    def _engine_lost(self, state: ServiceState, message: str, request_error: str) -> None:
        """The engine failed or never loaded: so do its live requests, and its queued work is void."""
        self._set_state(state)
        self.last_error = message
        self._forget_engine()
        self._inbox.clear()  # the next engine starts empty: queued submissions and aborts are void
        self._unapplied = 0
        self._fail_all(request_error)

    def _forget_engine(self) -> None:
        # A dead or unloaded engine's numbers must not live on in /metrics, /stats or /health.
        self._stats = None
        self.kernel_report = None
        self.model_check = None

    async def drain(self, timeout_s: float) -> None:
        """A graceful shutdown: admit nothing new, let live requests finish for up to `timeout_s`, then end
        the rest with an error (their streams get an error event and their end, not a cut connection)."""
        self._stopping = True
        self._notify()  # requests waiting for a load give up now
        self._emptied = trio.Event()
        with trio.move_on_after(timeout_s):
            if self._live:
                await self._emptied.wait()
        if self._live:
            log.warning("model %s: %d requests still running after %s s; ending them", self.model_name,
                        len(self._live), timeout_s)
            for rid in self._live:  # free their blocks: the engine is still up
                self._inbox.append(Abort(rid))
            self._wakeup.set()
            self._fail_all(lambda: EngineUnavailable("the server is shutting down", code="shutting_down"))
        self._drained.set()

    async def wait_drained(self) -> None:
        await self._drained.wait()

    def _fail_all(self, error: str | Callable[[], Exception]) -> None:
        """End every live generation with an error (GenerationFailed(error), or error()) and abort it."""
        live, self._live = self._live, {}
        self._emptied.set()
        for handle in {id(h): h for h in live.values()}.values():
            handle.fail(GenerationFailed(error) if isinstance(error, str) else error())

    @property
    def healthy(self) -> bool:
        """Ready, or unloaded on purpose (the next request loads it)."""
        return self.state in (ServiceState.READY, ServiceState.UNLOADED)

    @property
    def problem(self) -> str | None:
        """What is wrong, for /health: generic on purpose (the details are in the server log)."""
        state = self.state
        if state is ServiceState.LOAD_FAILED:
            return "the model could not be loaded; see the server log"
        if state is ServiceState.STOPPING:
            return "the server is shutting down"
        if self.last_error is not None:
            return "the engine failed; see the server log"
        return None

    @property
    def num_restarts(self) -> int:
        return self._num_restarts

    @property
    def restart_backoff_s(self) -> float:
        return self._config.restart_backoff_s

    def statistics(self) -> ServiceStatistics:
        return ServiceStatistics(self.state, len(self._live), self._num_restarts, self._num_steps,
                                 self._num_idle_steps, self._epoch, self._stats)

    def drain_reports(self) -> list[StepReport]:
        """The step reports (load + KV events) since the previous call, oldest first."""
        reports = list(self._reports)
        self._reports.clear()
        return reports

    # ---- requests (trio thread) ----

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | list[SamplingParams],
               *, priority: int = 0, deadline: float | None = None) -> GenerationHandle:
        """Queue one prompt for n = len(params) generations; the caller must `close()` the handle.

        Admission is decided here, synchronously: EngineUnavailable while the model loads or restarts,
        InvalidRequest for what could never be served, Overloaded when the waiting queue is full.
        """
        return self.submit_prompts([prompt_token_ids], params if isinstance(params, list) else [params],
                                   priority=priority, deadline=deadline)

    def submit_prompts(self, prompts: Sequence[list[int]], params: list[SamplingParams], *,
                       priority: int = 0, deadline: float | None = None,
                       trace: RequestTrace | None = None) -> GenerationHandle:
        """Queue each prompt for len(params) generations, all behind one handle (request ids prompt-major: one
        prompt's n, then the next's); the engine batches them like any other requests. Admitted all or none.
        `deadline` (trio time): past it the handle ends them with FinishReason.TIMEOUT and aborts them."""
        if self.state is not ServiceState.READY or self.limits is None:
            raise self.unavailable()
        for prompt in prompts:
            self.limits.check_token_ids(prompt)  # a 400 here, not a refusal on the engine thread
            for p in params:
                self.limits.check(len(prompt), p)
        total = len(prompts) * len(params)
        self.limits.check_group(total)  # one request's share of the queue: its own 400, before any 503
        waiting = (self._stats.num_waiting if self._stats is not None else 0) + self._unapplied
        if waiting + total > self.limits.max_waiting:
            raise Overloaded(f"the waiting queue is full ({self.limits.max_waiting} requests)")
        rids = tuple(f"req-{next(self._ids)}" for _ in range(total))
        handle = GenerationHandle(rids, abort=self._abort, channel_size=self._config.channel_size,
                                  max_buffered_bytes=self._config.max_buffered_bytes, metrics=self.metrics,
                                  deadline=deadline, trace=trace,
                                  prompt_lengths=tuple(len(prompt) for prompt in prompts for _ in params))
        if trace is not None:
            trace.on_submitted(rids)
        work = ((prompt, p) for prompt in prompts for p in params)
        if deadline is not None:
            if len(self._deadlines) > 2 * len(self._live) + 64:  # drop handles that are done with
                self._deadlines = [d for d in self._deadlines if not d[2].expire()]
                heapq.heapify(self._deadlines)
            heapq.heappush(self._deadlines, (deadline, id(handle), handle))
        for rid, (prompt, p) in zip(rids, work):
            self._live[rid] = handle
            self._inbox.append(Submit(rid, list(prompt), p, priority, group=rids[0]))
        self._unapplied += total
        self._wakeup.set()
        return handle

    def _forget(self, request_id: str) -> GenerationHandle | None:
        handle = self._live.pop(request_id, None)
        if not self._live:
            self._emptied.set()
        return handle

    def _abort(self, request_id: str) -> None:
        if self._forget(request_id) is not None:
            self._inbox.append(Abort(request_id))
            self._wakeup.set()

    # ---- the shells' side of the hop (trio thread) ----

    def _on_engine_started(self, engine: LLMEngine, stats: EngineStatistics) -> list[Work] | None:
        """The new engine is up: READY. None if the service was cancelled meanwhile (the thread then quits)."""
        if self._stopped.is_set():
            return None
        self._engine_up = True
        self._load_failures = 0
        self._stats = stats
        self.tokenizer = engine.tokenizer
        self.limits = engine.limits
        self.kernel_report = engine.kernel_report
        self.model_check = engine.probe_result
        self.kv_cache_spec = KVCacheSpec.of(engine.block_manager, engine.loaded.model_id)
        self.model_name = self._served_name or engine.model_name
        self._epoch += 1
        self._reports.clear()  # the old engine's events name blocks the new one never had
        self._up_since = trio.current_time()
        self._set_state(ServiceState.READY)
        self.last_error = None
        self._report_started()
        return self._take_work()

    def _take_work(self) -> list[Work]:
        work, self._inbox = self._inbox, []
        self._unapplied = sum(isinstance(w, Submit) for w in work)  # in flight until the next delivery
        self._wakeup = trio.Event()
        return work

    async def _wait_for_work_or_idle(self, release_after_s: float | None = None) -> list[Work] | None:
        """The next work; None (and UNLOADED) after `unload_after_idle_s` without any, or once run() is over;
        [] after `release_after_s` without any (the engine then shrinks its KV pool)."""
        timeout = self._config.unload_after_idle_s
        with trio.move_on_after(math.inf if timeout is None else timeout):
            with trio.move_on_after(math.inf if release_after_s is None else release_after_s):
                # (On the threaded shell this runs in a system task, which run()'s cancellation cannot reach:
                # run() sets _stopped and the wakeup when it ends.)
                while not self._inbox and not self._stopped.is_set():
                    self._raise_declared_failure()
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                if self._stopped.is_set():
                    return None
                return self._take_work()
            return self._take_work()  # [] unless work arrived in the very tick the release fired
        if self._inbox:  # arrived in the very tick the deadline fired: serve it
            return self._take_work()
        self._set_state(ServiceState.UNLOADED)  # from now on a request waits for a reload (ensure_loaded)
        self._forget_engine()
        return None

    def _deliver(self, result: StepResult) -> list[Work]:
        """Hand one step's results to their handles; returns the work that arrived meanwhile."""
        self._raise_declared_failure()
        now = trio.current_time()
        while self._deadlines and self._deadlines[0][0] <= now:  # past their deadline: end and abort them
            heapq.heappop(self._deadlines)[2].expire()
        self._stats = result.statistics
        for rid in result.prefilling:  # the request left the queue (its queue time; traces' spans)
            handle = self._live.get(rid)
            if handle is not None:
                handle.on_prefill(rid)
        if result.report is not None:
            self._reports.append(result.report)
        if result.ran:
            self._num_steps += 1
        for rid in result.added:
            handle = self._live.get(rid)
            if handle is not None:
                handle.on_added(rid)
        for rejected in result.rejected:
            handle = self._forget(rejected.request_id)
            if handle is not None:
                handle.on_rejected(rejected.request_id, rejected.error)
        for out in result.outputs:
            handle = self._live.get(out.request_id)
            if handle is None:
                continue  # aborted meanwhile: its abort is in the inbox
            if out.finished:
                self._forget(out.request_id)
            handle.feed(out)
        return self._take_work()

    # ---- the two shells ----

    def _run_threaded(self) -> None:
        """The engine thread: build the engine here (its MLX streams belong to this thread), then step."""
        engine = self._factory()
        try:
            driver = EngineDriver(engine)
            started = trio.from_thread.run_sync(self._on_engine_started, engine, engine.statistics())
            if started is None:
                return  # the service stopped while the model loaded
            work = started
            while True:
                trio.from_thread.check_cancelled()
                if not work and driver.idle:
                    idle_work = trio.from_thread.run(self._wait_for_work_or_idle, driver.release_after_s)
                    if idle_work is None:
                        return  # unload: dropping the engine frees the model and its KV cache
                    work = idle_work
                result = driver.run_once(work, check_abort=trio.from_thread.check_cancelled)
                work = trio.from_thread.run_sync(self._deliver, result)
        finally:
            try:
                engine.close()  # its disk tier keeps the prefix cache for a restart
            except Exception:  # never in the way of the error that ended the loop
                log.exception("closing the engine of %s failed", self.model_name)

    async def _run_inline(self) -> None:
        """The engine in this task: each step's (simulated) duration passes before its tokens are delivered."""
        engine = self._factory()
        driver = EngineDriver(engine)
        started = self._on_engine_started(engine, engine.statistics())
        if started is None:
            return
        work = started
        while True:
            if not work and driver.idle:
                idle_work = await self._wait_for_work_or_idle()
                if idle_work is None:
                    return
                work = idle_work
            result = driver.run_once(work)
            if result.ran and result.step_s > 0:
                await trio.sleep(result.step_s)
            elif result.ran or not driver.idle:
                # A step that took no time or scheduled nothing still lets time pass, or a virtual clock spins.
                self._num_idle_steps += 1
                await trio.sleep(self._config.idle_step_s)
            else:
                await trio.sleep(0)
            work = self._deliver(result)
