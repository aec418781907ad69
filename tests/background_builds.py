"""Builds and checks a few tests need, started when collection finds those tests and run at the lowest CPU
priority, so they use the time other tests leave a core idle (waiting on servers, sockets, sleeps) instead of
the suite's own: the AVX2 build of the CPU extension on a wider CPU costs a minute or more of both cores, mypy
over the packages ~40 s of one, the aarch64 cross-compiles of the NEON tests ~45 s of one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "web", "bench")

_BUILDS: dict[str, subprocess.Popen[str]] = {}

AVX2_EXTENSION = "avx2-extension"
MYPY = "mypy"
NEON_SOURCES = "neon-sources"
_ENV = {AVX2_EXTENSION: {"TRILLM_CPU_ISA": "avx2"}}
_NEON = ROOT / "tests" / "kernels" / "test_neon_cross.py"
_OUT: list[Path] = []  # made by the first job that writes a file (the jobs import this module too)


def neon_bodies(index: int) -> str:
    """The name of the job that cross-compiles the NEON kernel bodies for test_neon_cross.ARM_ISAS[index]."""
    return f"neon-bodies-{index}"


def output_path(name: str) -> Path:
    """Where job `name` writes what it builds."""
    if not _OUT:
        _OUT.append(Path(tempfile.mkdtemp(prefix="trillm-background-")))
    return _OUT[0] / name


def mypy_command() -> tuple[list[str], Path]:
    """mypy over the packages (strict per pyproject.toml) and the folder to run it in. The folders install as
    trillm.<name>; mypy gets the same layout through symlinks, in a stable place so its incremental cache
    works from one run to the next."""
    work = ROOT / ".mypy_cache"
    pkg = work / "src" / "trillm"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = pkg / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(work / "cache"), *(f"-p=trillm.{n}" for n in PACKAGES)]
    return cmd, work / "src"


def _command(name: str) -> tuple[list[str], Path | None]:
    if name == AVX2_EXTENSION:
        return [sys.executable, "-c", "from trillm.kernels import cpu_ext; cpu_ext.build()"], None
    if name == MYPY:
        return mypy_command()
    if name == NEON_SOURCES:
        return [sys.executable, str(_NEON), "sources"], None
    if name.startswith("neon-bodies-"):
        return [sys.executable, str(_NEON), "bodies", name.rsplit("-", 1)[1], str(output_path(name))], None
    raise KeyError(name)


def start(name: str) -> None:
    """Start build `name` in the background (once); a failure is the waiting test's to report."""
    if name in _BUILDS:
        return
    env = dict(os.environ, **_ENV.get(name, {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TRILLM_CPU_EXT", None)
    nice = ["nice", "-n", "19"] if os.name == "posix" else []
    cmd, cwd = _command(name)
    _BUILDS[name] = subprocess.Popen([*nice, *cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)


def wait(name: str, timeout: float = 900.0) -> tuple[int, str] | None:
    """Wait for build `name` if it was started: its exit status and output (None if it was not started: the test
    runs it itself)."""
    proc = _BUILDS.pop(name, None)
    if proc is None:
        return None
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def stop_all() -> None:
    for proc in _BUILDS.values():
        proc.kill()
        proc.wait()
    _BUILDS.clear()
    for folder in _OUT:
        shutil.rmtree(folder, ignore_errors=True)
    _OUT.clear()
