"""silu(gate) * up, the SwiGLU MLP's activation: the reference, the CPU primitive and the dispatcher.

On CPU, MLX evaluates it with a scalar exp on one thread (~15% of a 512-token prefill chunk for SmolLM2);
the CPU primitive (kernels/cpu/silu_mul.cpp) is one vectorised pass split across the cores.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from trillm.kernels import cpu_ext

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def silu_mul_ref(gate: mx.array, up: mx.array) -> mx.array:
    """gate, up [...] (same shape) -> silu(gate) * up, as mlx-lm's swiglu."""
    out: mx.array = nn.silu(gate) * up
    return out


def silu_mul_cpu(gate: mx.array, up: mx.array) -> mx.array:
    """`silu_mul` as a primitive of trillm's CPU extension. Shapes as the reference."""
    ext = cpu_ext.load()
    if ext is None:
        raise RuntimeError(f"trillm's CPU extension is unavailable: {cpu_ext.status().reason}")
    out: mx.array = ext.silu_mul(gate, up)
    return out


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up: the CPU primitive on CPU, else the reference."""
    if (cpu_ext.enabled() and gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _DTYPES
            and cpu_ext.load() is not None):  # fmt: skip
        return silu_mul_cpu(gate, up)
    return silu_mul_ref(gate, up)
