"""The ranks of a tensor-parallel group: MLX's own `mx.distributed` group, the worker processes of a
single-host group, the doorbell that wakes them, and the group's health.

Rank 0 serves; every other rank runs `trillm.engine.tp_worker` (tp_worker.py). On one host `LocalRanks` starts
ranks 1..N-1 as child processes on the ring backend over loopback; across hosts `mlx.launch` starts every rank
(any backend) and `launched_by_mlx()` tells `trillm serve` so.

Why a doorbell: MLX's collectives busy-poll (the ring backend spins on non-blocking sockets), so a worker
waiting inside `all_sum` for rank 0's next message keeps a core busy even while the server is idle. A local
worker instead blocks on a pipe from rank 0, which writes one byte before each message. Workers started by
`mlx.launch` have no doorbell and wait inside the collective, as mlx-lm's server does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from trillm.engine.errors import EngineError

log = logging.getLogger("trillm.engine.distributed")

DOORBELL_FD_ENV = "TRILLM_TP_DOORBELL_FD"  # a local worker's read end of its doorbell pipe
PARENT_PID_ENV = "TRILLM_TP_PARENT_PID"  # a local worker dies with this process
BACKENDS = ("any", "ring", "mpi", "jaccl", "nccl")
_LAUNCHER_RANK_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # mlx.launch, mpirun
_MESSAGE, _QUIT = b"m", b"q"


class TensorParallelError(EngineError):
    """The tensor-parallel group cannot serve: a model that does not shard, a rank that died or hangs."""


def launched_by_mlx() -> bool:
    """Whether a distributed launcher (`mlx.launch`, mpirun) started this process as one rank of a group."""
    return any(name in os.environ for name in _LAUNCHER_RANK_ENV)


class Doorbell:
    """Rank 0 writes one byte per worker before each message; a worker blocks reading it (no busy-wait)."""

    def __init__(self, write_fds: Sequence[int] = (), read_fd: int | None = None) -> None:
        self._write_fds = list(write_fds)
        self._read_fd = read_fd

    def ring(self) -> None:
        """A message follows (rank 0). A worker that is gone shows up here as a broken pipe."""
        for fd in self._write_fds:
            try:
                os.write(fd, _MESSAGE)
            except OSError as exc:
                raise TensorParallelError(f"a tensor-parallel worker is gone: {exc}") from exc

    def wait(self) -> bool:
        """Block until rank 0 rings (True), or quits or dies (False; a dead rank 0 closes the pipe)."""
        assert self._read_fd is not None
        try:
            byte = os.read(self._read_fd, 1)
        except OSError:
            return False
        return byte == _MESSAGE

    def close(self) -> None:
        """Tell every worker to exit (rank 0)."""
        fds, self._write_fds = self._write_fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.write(fd, _QUIT)
            with contextlib.suppress(OSError):
                os.close(fd)


class TensorParallelGroup:
    """One process's view of the group: the mx.distributed group and what the rank-0 watchdog reads.

    `waiting_since` is set while rank 0 waits on the other ranks (a step in flight) and read from another
    thread by the watchdog, which declares a hang past its timeout. `failure` is the first reason the group
    became unusable; once set, it never serves again (a half-finished collective cannot be resumed).
    """

    def __init__(self, group: mx.distributed.Group, doorbell: Doorbell | None = None) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.doorbell = doorbell
        self.waiting_since: float | None = None
        self.failure: str | None = None

    @classmethod
    def connect(cls, backend: str = "any", doorbell: Doorbell | None = None) -> TensorParallelGroup:
        """Join the group the environment describes (MLX_RANK/MLX_HOSTFILE, or the backend's own); blocks
        until every rank has joined."""
        if backend not in BACKENDS:
            raise TensorParallelError(f"unknown distributed backend {backend!r}; pick one of {', '.join(BACKENDS)}")
        try:
            group = mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as exc:
            raise TensorParallelError(f"cannot join the distributed group ({backend} backend): {exc}") from exc
        return cls(group, doorbell)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self.waiting_since = time.monotonic()
        try:
            yield
        finally:
            self.waiting_since = None

    def waited_s(self) -> float:
        since = self.waiting_since
        return 0.0 if since is None else time.monotonic() - since

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason

    def error(self, exc: BaseException) -> TensorParallelError:
        """Mark the group failed by `exc` and return the error to raise (with the first known reason)."""
        self.fail(f"{type(exc).__name__}: {exc}")
        return TensorParallelError(f"tensor-parallel group failed: {self.failure}")

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(f"tensor-parallel group failed ({self.failure}); it cannot recover: "
                                      "restart the server")


@dataclass(frozen=True, slots=True)
class RankExit:
    rank: int
    returncode: int

    def __str__(self) -> str:
        how = f"was killed by {signal.Signals(-self.returncode).name}" if self.returncode < 0 else \
            f"exited with code {self.returncode}"
        return f"tensor-parallel rank {self.rank} {how}"


class LocalRanks:
    """Ranks 1..N-1 of a single-host group, as child processes of rank 0 (this process), on the ring backend
    over loopback. `start` also sets this process's own MLX_RANK/MLX_HOSTFILE, so `TensorParallelGroup.connect
    ("ring", ranks.doorbell)` makes it rank 0.

    No orphans: each worker exits when its doorbell closes, dies with rank 0 (PR_SET_PDEATHSIG on Linux), and
    `stop` escalates to SIGTERM then SIGKILL. Workers run in their own session, so a terminal's Ctrl-C reaches
    rank 0 only, and rank 0 stops them in order.
    """

    def __init__(self, procs: list[subprocess.Popen[bytes]], doorbell: Doorbell, tmpdir: str) -> None:
        self.procs = procs
        self.doorbell = doorbell
        self._tmpdir = tmpdir

    @property
    def size(self) -> int:
        return len(self.procs) + 1

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @classmethod
    def start(cls, size: int, command: Sequence[str] | None = None,
              env: dict[str, str] | None = None) -> LocalRanks:
        """Spawn ranks 1..size-1 running `command` (default: `python -m trillm.engine.tp_worker`)."""
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {size}")
        argv = list(command or [sys.executable, "-m", "trillm.engine.tp_worker"])
        tmpdir = tempfile.mkdtemp(prefix="trillm-tp-")
        hostfile = Path(tmpdir) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in _free_ports(size)]))
        procs: list[subprocess.Popen[bytes]] = []
        write_fds: list[int] = []
        try:
            for rank in range(1, size):
                read_fd, write_fd = os.pipe()
                child_env = {**os.environ, **(env or {}), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
                             DOORBELL_FD_ENV: str(read_fd), PARENT_PID_ENV: str(os.getpid())}
                try:
                    procs.append(subprocess.Popen(argv, env=child_env, pass_fds=(read_fd,), stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
                finally:
                    os.close(read_fd)
                write_fds.append(write_fd)
        except BaseException:
            cls(procs, Doorbell(write_fds), tmpdir).stop(grace_s=0.0)
            raise
        os.environ["MLX_RANK"] = "0"
        os.environ["MLX_HOSTFILE"] = str(hostfile)
        log.info("started tensor-parallel ranks 1..%d (pids %s), ring over loopback", size - 1,
                 " ".join(str(p.pid) for p in procs))
        return cls(procs, Doorbell(write_fds), tmpdir)

    def poll(self) -> list[RankExit]:
        """The workers that have exited, by rank."""
        return [RankExit(rank, code) for rank, p in enumerate(self.procs, start=1)
                if (code := p.poll()) is not None]

    def kill(self) -> None:
        """SIGKILL every worker still alive: a collective rank 0 is blocked in then fails instead of hanging."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask every worker to exit, then SIGTERM, then SIGKILL; reap them all."""
        self.doorbell.close()
        for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                break
            for p in alive:
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(sig)
            deadline = time.monotonic() + wait_s
            for p in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _free_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago (the ring backend binds them itself)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def die_with_parent() -> None:
    """In a local worker: exit when rank 0 does, even if it is SIGKILLed (Linux), and ignore Ctrl-C, which
    rank 0 handles by stopping the workers in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = int(os.environ.get(PARENT_PID_ENV, "0"))
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent and os.getppid() != parent:  # rank 0 died before the line above took effect
        os._exit(1)


def worker_doorbell() -> Doorbell | None:
    """A local worker's doorbell (from its environment); None for a rank started by mlx.launch."""
    fd = os.environ.get(DOORBELL_FD_ENV)
    return Doorbell(read_fd=int(fd)) if fd is not None else None
