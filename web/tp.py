"""`trillm serve` over a tensor-parallel group: rank 0 serves HTTP and runs the engine; a watchdog fails the
model (every open stream ends with an error, /health turns 503) when a rank dies or hangs.

On one host (`--tensor-parallel N`) rank 0 starts ranks 1..N-1 itself (engine/distributed.py, LocalRanks) and
owns them: a rank that exits, or a step that waits on the others longer than the timeout, trips the
watchdog, which kills every worker so that a collective rank 0 is blocked in fails instead of hanging; the
group cannot be rebuilt in-process (MLX keeps one group per process), so the model stays unhealthy until the
server is restarted. Shutdown stops every rank. Under `mlx.launch` the launcher owns the ranks (it stops all
of them when one exits); rank 0 cannot break a hang of a remote rank, so it fails the model and, after a
grace period, exits so that the launcher stops the rest.
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
from trillm.web.service import EngineService, ServiceConfig

log = logging.getLogger("trillm.web.tp")


@dataclass(frozen=True, slots=True)
class TensorParallelOptions:
    size: int
    timeout_s: float = 60.0  # a step waiting this long on the other ranks means one of them hangs
    poll_s: float = 0.2
    exit_after_s: float = 5.0  # no local ranks to kill: how long to report unhealthy before exiting

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"--tensor-parallel needs at least 2 ranks, got {self.size}")
        if self.timeout_s <= 0:
            raise ValueError("the tensor-parallel timeout must be > 0")


class RankWatchdog:
    """Trips on the first sign that the group cannot serve: a local rank exited, a step has waited on the
    other ranks for longer than the timeout, or the engine found the group broken."""

    def __init__(self, tp: TensorParallelGroup, ranks: LocalRanks | None, options: TensorParallelOptions) -> None:
        self.tp = tp
        self.ranks = ranks
        self.options = options
        self.service: EngineService | None = None
        self.stopping = False  # the engine has stopped: ranks exiting now is expected
        self.tripped: str | None = None

    def check(self) -> str | None:
        if self.ranks is not None and (exited := self.ranks.poll()):
            return "; ".join(map(str, exited))
        if self.tp.waited_s() > self.options.timeout_s:
            return (f"a tensor-parallel step has waited {self.options.timeout_s:g} s for the other ranks: "
                    "one of them hangs")
        return self.tp.failure

    def trip(self, reason: str) -> None:
        self.tripped = reason
        log.error("%s; the model is unavailable until the server restarts", reason)
        self.tp.failure = reason  # more telling than the collective's "connection lost", which may come first
        if self.service is not None:
            self.service.fail(TensorParallelError(reason))
        if self.ranks is not None:
            self.ranks.kill()  # the engine thread, if inside a collective, now gets an error instead of waiting

    async def run(self) -> None:
        try:
            while (reason := self.check()) is None or self.stopping:
                await trio.sleep(self.options.poll_s)
            self.trip(reason)
            if self.ranks is None:
                await trio.sleep(self.options.exit_after_s)
                log.critical("rank 0 cannot stop the other ranks of this group; exiting so that the launcher "
                             "stops them")
                logging.shutdown()
                os._exit(1)
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


async def serve_tensor_parallel(
    name: str | None, config: EngineConfig, server_config: ServerConfig, options: TensorParallelOptions, *,
    tp: TensorParallelGroup | None = None, service_config: ServiceConfig = ServiceConfig(),
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one model over a tensor-parallel group until cancelled or `shutdown_trigger` returns.

    tp: the group `mlx.launch` started (this process is its rank 0); None: start `options.size` ranks on
    this host.
    """
    ranks = LocalRanks.start(options.size) if tp is None else None
    factory: TensorParallelEngine | None = None
    try:
        if ranks is not None:
            tp = await _connect(ranks, options.poll_s)
        assert tp is not None
        factory = TensorParallelEngine(config, tp)
        watchdog = RankWatchdog(tp, ranks, options)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watchdog.run)

            async def serve_then_stop(task_status: trio.TaskStatus[Serving]) -> None:
                assert factory is not None
                await serve([ModelSpec(name, factory)], server_config, service_config=service_config,
                            shutdown_trigger=shutdown_trigger, task_status=task_status)
                watchdog.stopping = True
                nursery.cancel_scope.cancel()

            serving: Serving = await nursery.start(serve_then_stop)
            watchdog.service = serving.services[0]
            task_status.started(serving)
    finally:
        with trio.CancelScope(shield=True):
            if factory is not None:
                with trio.move_on_after(10):  # a hung remote rank must not keep rank 0 from exiting
                    await trio.to_thread.run_sync(factory.close, abandon_on_cancel=True)
            if ranks is not None:
                await trio.to_thread.run_sync(ranks.stop)
