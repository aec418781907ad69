"""The results folder every benchmark writes under, with the machine, versions and flags recorded."""

from __future__ import annotations

import argparse
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
    """A new folder results/<timestamp>[-N]/ (or root/<name>, reused if it exists).

    Two runs started in the same second get two folders: the second one takes the next free suffix.
    """
    base = Path(root) if root is not None else Path("results")
    base.mkdir(parents=True, exist_ok=True)
    if name is not None:
        path = base / name
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(10_000):
        path = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"no free results folder for {stamp} under {base}")


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename: a crash or a full disk leaves either
    the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: Path, doc: object) -> Path:
    return write_text_atomic(path, json.dumps(doc, indent=1, default=str))


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers (an argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


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
    return write_json(path / "meta.json", meta)
