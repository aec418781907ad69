"""The results folder every benchmark writes under, with the machine, versions and flags recorded."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

_PACKAGES = ("trillm", "mlx", "mlx-lm", "trio", "quart", "quart-trio", "hypercorn", "httpx", "trio-websocket")


def new_results_dir(root: str | os.PathLike[str] | None = None, name: str | None = None) -> Path:
    """results/<timestamp>/ (or root/<name>), created; an existing folder is reused."""
    base = Path(root) if root is not None else Path("results")
    path = base / (name or _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict[str, object]:
    """Machine, OS, Python, package versions, BLAS and git commit."""
    from trillm.kernels import BLAS  # loads the BLAS before mlx, as everywhere

    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "python": sys.version.split()[0],
        "packages": {p: _version(p) for p in _PACKAGES},
        "blas": {"name": BLAS.name, "path": BLAS.path, "effective": BLAS.effective},
        "git_commit": _git_commit(),
        "time": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def write_meta(path: Path, command: str, argv: list[str], flags: dict[str, object]) -> Path:
    """meta.json: what ran, with which flags, on what."""
    meta = {"command": command, "argv": argv, "flags": flags, "machine": machine_info()}
    out = path / "meta.json"
    out.write_text(json.dumps(meta, indent=2, default=str))
    return out
