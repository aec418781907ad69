"""RMSNorm over the last axis: the reference (`mx.fast.rms_norm`), the CPU primitive and the dispatcher.

On CPU, MLX runs `mx.fast.rms_norm` as its composite fallback (square, mean, add, rsqrt, two multiplies:
six ops per norm, two norms per layer); the CPU primitive (kernels/cpu/rms_norm.cpp) is one pass per row.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels import cpu_ext

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def rms_norm_ref(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x [..., D], weight [D] -> x * rsqrt(mean(x^2, -1) + eps) * weight, in x's dtype."""
    return mx.fast.rms_norm(x, weight, eps)


def rms_norm_cpu(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`rms_norm` as a primitive of trillm's CPU extension. Shapes as the reference."""
    ext = cpu_ext.load()
    if ext is None:
        raise RuntimeError(f"trillm's CPU extension is unavailable: {cpu_ext.status().reason}")
    out: mx.array = ext.rms_norm(x, weight, eps)
    return out


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """RMSNorm of x [..., D] with weight [D]: the CPU primitive on CPU, else the reference."""
    if cpu_ext.enabled() and x.dtype in _DTYPES and weight.ndim == 1 and cpu_ext.load() is not None:
        return rms_norm_cpu(x, weight, eps)
    return rms_norm_ref(x, weight, eps)
