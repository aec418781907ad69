"""mypy (strict for trillm.engine, trillm.kernels, trillm.web; see [tool.mypy] in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "web", "bench")


def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    # The folders install as trillm.<name>; give mypy the same layout through symlinks (in a stable place, so
    # its incremental cache works from one run to the next).
    work = ROOT / ".mypy_cache"
    pkg = work / "src" / "trillm"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = pkg / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(work / "cache"), *(f"-p=trillm.{n}" for n in PACKAGES)]
    proc = subprocess.run(cmd, cwd=work / "src", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
