"""Start and stop servers under test as child processes, ready once GET /health (or their own path) answers 200."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """A server under test exited or never became healthy."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def blas_env() -> dict[str, str]:
    """The environment with trillm's BLAS preloaded, so every server's MLX uses the same matmuls."""
    from trillm.kernels import BLAS

    env = dict(os.environ)
    if BLAS.path:
        env["LD_PRELOAD"] = " ".join(p for p in (BLAS.path, env.get("LD_PRELOAD", "")) if p)
    return env


def trillm_command(model: str | None, port: int, extra: Sequence[str] = ()) -> list[str]:
    """`trillm serve` on loopback; model None serves its default model."""
    chosen = ["--model", model] if model is not None else []
    return [sys.executable, "-m", "trillm.web.cli", "serve", *chosen, "--host", "127.0.0.1", "--port", str(port),
            *extra]


def mlx_lm_command(model: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *extra]


@dataclass
class ServerProcess:
    """One server child process; its output goes to log_path."""

    name: str
    command: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=blas_env)
    health_path: str = "/health"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Poll health_path until 200; returns seconds waited. Raises ServerStartError on exit or timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ServerStartError(f"{self.name} not healthy after {timeout_s:.0f}s; see {self.log_path}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM its process group, then SIGKILL after grace_s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
