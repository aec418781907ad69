"""kernels/tools/gpu_check.sh cannot run here (no GPU): it must parse, and stop cleanly saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kernels" / "tools" / "gpu_check.sh"


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_stops_with_status_2_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("GPU_CHECK_ANYWAY", None)
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no Metal/CUDA back-end" in (tmp_path / "env.txt").read_text()
    assert "stopping after env" in proc.stdout
