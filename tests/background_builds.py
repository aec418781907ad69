"""Builds a few tests need, started when collection finds those tests and run at the lowest CPU priority, so
they use the time other tests leave a core idle (waiting on servers, sockets, sleeps) instead of the suite's
own: the AVX2 build of the CPU extension on a wider CPU costs a minute or more of both cores."""

from __future__ import annotations

import os
import subprocess
import sys

_BUILDS: dict[str, subprocess.Popen[str]] = {}

AVX2_EXTENSION = "avx2-extension"
_COMMANDS = {
    AVX2_EXTENSION: [sys.executable, "-c", "from trillm.kernels import cpu_ext; cpu_ext.build()"],
}
_ENV = {AVX2_EXTENSION: {"TRILLM_CPU_ISA": "avx2"}}


def start(name: str) -> None:
    """Start build `name` in the background (once); a failure is the waiting test's to report."""
    if name in _BUILDS:
        return
    env = dict(os.environ, **_ENV.get(name, {}))
    env.pop("TRILLM_CPU_EXT", None)
    nice = ["nice", "-n", "19"] if os.name == "posix" else []
    _BUILDS[name] = subprocess.Popen([*nice, *_COMMANDS[name]], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)


def wait(name: str, timeout: float = 900.0) -> str:
    """Wait for build `name` if it was started (else nothing: the test builds it itself); its output."""
    proc = _BUILDS.pop(name, None)
    if proc is None:
        return ""
    out, _ = proc.communicate(timeout=timeout)
    return out


def stop_all() -> None:
    for proc in _BUILDS.values():
        proc.kill()
        proc.wait()
    _BUILDS.clear()
