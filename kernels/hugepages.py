"""Large arrays backed by transparent huge pages, on Linux CPUs: one packed buffer for many weights.

Decode reads every weight once per step. Over 4 KiB pages the hardware prefetchers stop at each page and
every new page costs a TLB walk (a nested one in a VM): a core read ~8-17 GB/s here, ~28 GB/s over 2 MiB
pages. `pack(arrays)` copies arrays into one buffer, asks the kernel to back it with huge pages
(MADV_HUGEPAGE, then MADV_COLLAPSE: Linux 6.1+, whatever the system's THP setting) and returns views into it,
so small weights (a 1 MB projection cannot hold one aligned 2 MiB page) are covered too. Where this is not
possible (no CPU extension, another OS, an old kernel) the arrays still work; `Advice.error` says why.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx

from trillm.kernels import cpu_ext

ALIGN = 16  # elements: every view starts on a 64-byte boundary of the buffer (for fp32)


@dataclass(frozen=True, slots=True)
class Advice:
    nbytes: int  # the buffer's size
    advised: int  # bytes marked for huge pages
    collapsed: int  # bytes collapsed into huge pages now
    error: str  # why not all of it ("" when all went well)


def available() -> bool:
    return sys.platform.startswith("linux") and cpu_ext.enabled()


def advise(a: mx.array) -> Advice:
    """Ask for huge pages under `a` (evaluated first); only whole 2 MiB pages inside it are covered."""
    ext = cpu_ext.load() if available() else None
    if ext is None:
        return Advice(a.nbytes, 0, 0, "needs trillm's CPU extension on Linux")
    advised, collapsed, error = ext.advise_hugepages(a)
    return Advice(a.nbytes, int(advised), int(collapsed), str(error))


def pack(arrays: list[mx.array]) -> tuple[list[mx.array], Advice]:
    """The arrays (one dtype) copied into one huge-page buffer: views with their shapes and values."""
    if not arrays:
        return [], Advice(0, 0, 0, "")
    dtype = arrays[0].dtype
    if any(a.dtype != dtype for a in arrays):
        raise ValueError("pack takes arrays of one dtype")
    parts, offsets, at = [], [], 0
    for a in arrays:
        n = a.size
        pad = -n % ALIGN
        offsets.append(at)
        parts.append(a.reshape(-1))
        if pad:
            parts.append(mx.zeros((pad,), dtype))
        at += n + pad
    buffer = mx.concatenate(parts)
    mx.eval(buffer)
    advice = advise(buffer)
    views = [buffer[o : o + a.size].reshape(a.shape) for o, a in zip(offsets, arrays)]
    mx.eval(views)
    return views, advice
