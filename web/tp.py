"""`trillm serve` over a tensor-parallel group: rank 0 serves HTTP and runs the engine; a watchdog fails the
model (every open stream ends with an error, /health turns 503) when a rank dies or hangs.

On one host (`--tensor-parallel N`) rank 0 starts ranks 1..N-1 itself (engine/distributed.py, LocalRanks) and
owns them. The watchdog trips when a rank exits, when a step has waited on the other ranks past the timeout
(a rank hangs), or when the engine found the group broken; it then kills every local worker, so that a
collective rank 0 is blocked in fails rather than waits. The model stays unhealthy until the server is
restarted: MLX keeps one group per process, and after a lost peer its ring backend can leave rank 0's MLX
stream blocked for good. So shutting down a failed group does not wait for an engine thread blocked in it. Under `mlx.launch` the launcher owns the ranks (it stops all of them when one exits); rank 0 fails
the model the same way but cannot kill a hung remote rank: stop the whole launch (Ctrl-C).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from trillm.engine.config import EngineConfig
from trillm.engine.distributed import LocalRanks, TensorParallelError, TensorParallelGroup
from trillm.engine.tp_runner import TensorParallelEngine
from trillm.web.config import ServerConfig
from trillm.web.server import ModelSpec, Serving, serve
from trillm.web.service.engine_service import EngineService, ServiceConfig

log = logging.getLogger("trillm.web.tp")


@dataclass(frozen=True, slots=True)
class TensorParallelOptions:
    size: int
    timeout_s: float = 60.0  # a step waiting this long on the other ranks means one of them hangs
    poll_s: float = 0.2
    stuck_after_s: float = 1.0  # blocked this long in a collective of a failed group: it never returns

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"--tensor-parallel needs at least 2 ranks, got {self.size}")
        if self.timeout_s <= 0:
            raise ValueError("the tensor-parallel timeout must be > 0")


class RankWatchdog:
    """Trips on the first sign that the group cannot serve: a local rank exited, a step has waited on the
    other ranks past the timeout, or the engine found the group broken."""

    def __init__(self, tp: TensorParallelGroup, ranks: LocalRanks | None, options: TensorParallelOptions) -> None:
        self.tp = tp
        self.ranks = ranks
        self.options = options
        self.service: EngineService | None = None
        self.stopping = False  # the engine has stopped: ranks exiting now is expected

    def check(self) -> str | None:
        if self.ranks is not None and (exited := self.ranks.poll()):
            return "; ".join(map(str, exited))
        if self.tp.waited_s() > self.options.timeout_s:
            return (f"a tensor-parallel step has waited {self.options.timeout_s:g} s for the other ranks: "
                    "one of them hangs")
        return self.tp.failure

    def trip(self, reason: str) -> None:
        log.error("%s; the model is unavailable until the server restarts", reason)
        self.tp.failure = reason  # more telling than the collective's "connection lost", which may come first
        if self.service is not None:
            self.service.fail(TensorParallelError(reason))
        if self.ranks is not None:
            self.ranks.kill()

    async def run(self) -> None:
        try:
            while (reason := self.check()) is None or self.stopping:
                await trio.sleep(self.options.poll_s)
            self.trip(reason)
        finally:
            if not self.stopping and self.ranks is not None:
                self.ranks.kill()  # cancelled while the engine may be inside a collective: let that fail


async def _connect(ranks: LocalRanks, poll_s: float) -> TensorParallelGroup:
    """Join the local group as rank 0; a worker that exits first fails the start instead of hanging it."""
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            while not (exited := ranks.poll()):
                await trio.sleep(poll_s)
            raise TensorParallelError(f"{exited[0]} before joining the group")

        nursery.start_soon(watch)
        tp = await trio.to_thread.run_sync(partial(TensorParallelGroup.connect, "ring", ranks.doorbell),
                                           abandon_on_cancel=True)
        nursery.cancel_scope.cancel()
    return tp


def _exit_without_engine(ranks: LocalRanks | None, failure: str) -> None:
    log.error("the engine thread is still blocked in a collective of the failed group (%s); exiting without it",
              failure)
    if ranks is not None:
        ranks.stop(grace_s=0.0)
    logging.shutdown()
    os._exit(1)


async def serve_tensor_parallel(
    name: str | None, config: EngineConfig, server_config: ServerConfig, options: TensorParallelOptions, *,
    tp: TensorParallelGroup | None = None, service_config: ServiceConfig = ServiceConfig(),
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> str | None:
    """Serve one model over a tensor-parallel group until `shutdown_trigger` returns; returns why the group
    failed, if it did.

    tp: the group `mlx.launch` started (this process is its rank 0); None: start `options.size` ranks on
    this host.
    """
    ranks = LocalRanks.start(options.size) if tp is None else None
    factory: TensorParallelEngine | None = None
    try:
        if ranks is not None:
            tp = await _connect(ranks, options.poll_s)
        assert tp is not None
        group = tp
        factory = TensorParallelEngine(config, group)
        watchdog = RankWatchdog(group, ranks, options)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watchdog.run)

            async def stop_when_asked() -> None:
                await (shutdown_trigger() if shutdown_trigger is not None else trio.sleep_forever())
                nursery.start_soon(abandon_a_stuck_engine)

            async def abandon_a_stuck_engine() -> None:
                # The ring backend fails the first collective after a lost peer; later ones wait forever.
                while group.failure is None or group.waited_s() < options.stuck_after_s:
                    await trio.sleep(options.poll_s)
                _exit_without_engine(ranks, group.failure)

            async def serve_then_stop(task_status: trio.TaskStatus[Serving]) -> None:
                assert factory is not None
                await serve([ModelSpec(name, factory)], server_config, service_config=service_config,
                            shutdown_trigger=stop_when_asked, task_status=task_status)
                watchdog.stopping = True
                nursery.cancel_scope.cancel()

            serving: Serving = await nursery.start(serve_then_stop)
            watchdog.service = serving.services[0]
            task_status.started(serving)
        return group.failure
    finally:
        with trio.CancelScope(shield=True):
            if factory is not None:
                with trio.move_on_after(10):  # a hung remote rank must not keep rank 0 from exiting
                    await trio.to_thread.run_sync(factory.close, abandon_on_cancel=True)
            if ranks is not None:
                await trio.to_thread.run_sync(ranks.stop)
