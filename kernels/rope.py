"""Rotary position embedding: the reference (`mx.fast.rope`), the CPU primitive and the dispatcher.

On CPU, MLX runs `mx.fast.rope` as its composite fallback (~20 ops per call: positions, frequencies,
cos, sin, slices, products, concatenation; two calls per layer). The CPU primitive (kernels/cpu/rope.cpp)
is one op that reads x through its strides, computes cos/sin once per position for every head, and writes
contiguous output.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels import cpu_ext

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def rope_ref(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float,
             offset: int | mx.array) -> mx.array:  # fmt: skip
    """x [B, H, L, D] (or [B, L, D]); offset: the first position, one int or one per batch row."""
    return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)


def rope_cpu(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float,
             offset: int | mx.array) -> mx.array:  # fmt: skip
    """`rope` as a primitive of trillm's CPU extension. Shapes as the reference."""
    ext = cpu_ext.load()
    if ext is None:
        raise RuntimeError(f"trillm's CPU extension is unavailable: {cpu_ext.status().reason}")
    offsets = mx.array([offset], mx.int32) if isinstance(offset, int) else offset
    out: mx.array = ext.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offsets)
    return out


def _cpu_supports(x: mx.array, dims: int, offset: int | mx.array) -> bool:
    rows_ok = isinstance(offset, int) or offset.size == 1 or (offset.ndim == 1 and offset.shape[0] == x.shape[0])
    return x.ndim in (3, 4) and x.dtype in _DTYPES and dims % 2 == 0 and dims <= x.shape[-1] and rows_ok


def rope(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float,
         offset: int | mx.array) -> mx.array:  # fmt: skip
    """RoPE (forward) of x: the CPU primitive on CPU, else the reference."""
    if cpu_ext.enabled() and _cpu_supports(x, dims, offset) and cpu_ext.load() is not None:
        return rope_cpu(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
    return rope_ref(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
