"""A `trillm serve` (or a script serving through the same code) in its own process, on a free port."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

HERE = Path(__file__).resolve().parent


def trillm(*args: str) -> list[str]:
    return [sys.executable, "-m", "trillm.web.cli", "serve", "--port", "0", *args]


class Server:
    """Its output (stdout and stderr) goes to a file, never a pipe it could fill; `url` is known once it
    logged its start."""

    def __init__(self, argv: list[str]) -> None:
        self._out = tempfile.TemporaryFile("w+")
        # cwd: scripts run with `python -c` import the test fixtures from this folder.
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, text=True, cwd=HERE)
        self.url = ""

    @property
    def log(self) -> list[str]:
        self._out.seek(0)
        return self._out.read().splitlines(keepends=True)

    def _find(self, marker: str) -> str | None:
        for line in self.log:
            if marker in line:
                return line
        if self.proc.poll() is not None:
            raise AssertionError("the server exited:\n" + "".join(self.log))
        return None

    async def wait_until(self, marker: str, timeout_s: float = 60) -> str:
        with trio.fail_after(timeout_s):
            while (line := self._find(marker)) is None:
                await trio.sleep(0.02)
        return line

    def _set_url(self, line: str) -> str:
        self.url = line.split(" at ", 1)[1].split("/v1", 1)[0]
        return self.url

    async def started(self) -> str:
        return self._set_url(await self.wait_until("trillm is serving"))

    def started_sync(self, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while (line := self._find("trillm is serving")) is None:
            assert time.monotonic() < deadline, "".join(self.log)
            time.sleep(0.02)
        return self._set_url(line)

    def terminate(self) -> float:
        self.proc.send_signal(signal.SIGTERM)
        return time.perf_counter()

    async def exit_code(self, timeout_s: float) -> int:
        with trio.fail_after(timeout_s):
            while self.proc.poll() is None:
                await trio.sleep(0.02)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
