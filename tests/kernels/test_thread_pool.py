"""The CPU kernels' thread pool under a loaded machine's races (pool_race.cpp): a worker woken for one call that
runs only while the caller publishes the next, and two threads calling at once. Built without mlx."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trillm.kernels import cpu_ext

DRIVER = Path(__file__).resolve().parent / "pool_race.cpp"
CXX = os.environ.get("CXX", "g++")


@pytest.mark.skipif(shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX})")
def test_every_item_runs_once_and_before_its_call_returns(tmp_path: Path) -> None:
    out = tmp_path / "pool_race"
    cmd = [CXX, "-std=c++20", "-O2", f"-I{cpu_ext.SOURCE_DIR}", str(DRIVER), "-o", str(out), "-lpthread"]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, f"{' '.join(cmd)} failed:\n{build.stderr[-3000:]}"
    run = subprocess.run([str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-2000:] + run.stderr[-2000:]
