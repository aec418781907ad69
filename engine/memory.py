"""The process's memory: what it holds now and at its peak, and the budget the KV pool grows within.

`--memory-limit` bounds the whole process (weights, activations, MLX's buffer cache and the KV pool), not
the pool alone: the pool may grow only while what the process holds outside it, plus the pool after the
growth, plus the copy the growth makes, fits the limit (engine/kv_slabs.py). The default is a fraction of
the machine: on Linux what the process holds plus the memory available to it (MemAvailable, and a cgroup's
memory.max when lower); on macOS Metal's recommended working set.
"""

from __future__ import annotations

import os
import re
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

DEFAULT_LIMIT_FRACTION = 0.9
_UNITS = {"": 1e9, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_size(text: str) -> int:
    """Bytes from "12GB", "512M", "8GiB" or a plain number of GB ("1.5")."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 12GB, 512MB, 8GiB, or a number of GB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"a memory size must be > 0, got {text!r}")
    return value


def process_rss() -> int:
    """Resident bytes of this process now (Linux); elsewhere what MLX holds (weights, pool, buffer cache)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import mlx.core as mx

        return int(mx.get_active_memory() + mx.get_cache_memory())


def peak_rss() -> int:
    """The most this process has held resident (getrusage's high-water mark)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room() -> int | None:
    """What a cgroup v2 memory.max still lets this process's group take, if one is set."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return int(cap) - int(f.read().strip())
    except (OSError, ValueError):
        return None


def default_memory_limit(fraction: float = DEFAULT_LIMIT_FRACTION) -> int | None:
    """A fraction of the machine for the whole process; None where neither source can be read."""
    if sys.platform == "darwin":
        try:
            import mlx.core as mx

            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            return int(fraction * int(info["max_recommended_working_set_size"]))
        except Exception:  # no Metal device: fall through to no limit
            return None
    room = [r for r in (_meminfo_available(), _cgroup_room()) if r is not None]
    if not room:
        return None
    return process_rss() + int(fraction * max(0, min(room)))


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
        return fn
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def release_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing).

    MLX's CPU buffers come from malloc; what the start-up self-check, the load probe and a shrunk pool free
    stays in glibc's arenas (its mmap threshold rises as large blocks are freed, so later ones come from the
    heap), resident and counted against --memory-limit: on SmolLM2-135M fp32, 1132 MiB idle after start
    without this, 711 MiB with it."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    rss_bytes: int
    peak_rss_bytes: int
    limit_bytes: int | None


class MemoryBudget:
    """The process's limit and a cheap view of what it holds (a reading is reused for `max_age_s`, since the
    block manager asks for every block it may hand out)."""

    def __init__(self, limit_bytes: int | None, *, usage: Callable[[], int] = process_rss,
                 max_age_s: float = 0.05) -> None:
        self.limit_bytes = limit_bytes
        self._usage = usage
        self._max_age_s = max_age_s
        self._sample = (-1.0, 0)

    def usage(self, *, fresh: bool = False) -> int:
        now = time.monotonic()
        if fresh or now - self._sample[0] > self._max_age_s:
            self._sample = (now, self._usage())
        return self._sample[1]

    def room_for_pool(self, pool_bytes: int) -> int | None:
        """Bytes the pool may take in all, beside what the process holds outside it (None: no limit)."""
        if self.limit_bytes is None:
            return None
        outside = max(0, self.usage() - pool_bytes)
        return max(0, self.limit_bytes - outside)

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(self.usage(), max(peak_rss(), self.usage()), self.limit_bytes)
