"""silu(gate) * up, the SwiGLU MLP's activation: the reference, the CPU primitive and the dispatcher.

On CPU, MLX evaluates it with a scalar exp on one thread (~15% of a 512-token prefill chunk for SmolLM2);
the CPU primitive (kernels/cpu/silu_mul.cpp) is one vectorised pass split across the cores.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from trillm.kernels import cpu_ext
from trillm.kernels.backend import (
    Case, Kernel, KernelOp, random_array, row_shapes, timing_rows,
)  # fmt: skip
from trillm.kernels.layout import ModelShapes

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# A polynomial exp (simd.h) against MLX's.
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (2e-5, 2e-5), mx.float16: (4e-3, 4e-3), mx.bfloat16: (3e-2, 3e-2),
}  # fmt: skip


def silu_mul_ref(gate: mx.array, up: mx.array) -> mx.array:
    """gate, up [...] (same shape) -> silu(gate) * up, as mlx-lm's swiglu."""
    out: mx.array = nn.silu(gate) * up
    return out


def silu_mul_cpu(gate: mx.array, up: mx.array) -> mx.array:
    """`silu_mul` as a primitive of trillm's CPU extension. Shapes as the reference."""
    out: mx.array = cpu_ext.require().silu_mul(gate, up)
    return out


def _cpu_supports_call(gate: mx.array, up: mx.array) -> bool:
    return gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _DTYPES


def silu_mul_cpu_kernel(gate: mx.array, up: mx.array) -> mx.array:
    """The "cpu" kernel the self-check runs: the primitive, or the reference for a call it does not take."""
    return silu_mul_cpu(gate, up) if _cpu_supports_call(gate, up) else silu_mul_ref(gate, up)


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up: the CPU primitive on CPU, else the reference. Unchecked: the engine runs what its
    start-up self-check chose (`trillm.kernels.selfcheck`)."""
    return (silu_mul_cpu_kernel if cpu_ext.enabled() else silu_mul_ref)(gate, up)


def _cases(shapes: ModelShapes, rows: list[tuple[str, int, int]], seed: int) -> list[Case]:
    f = shapes.intermediate
    out = []
    for i, (label, b, n) in enumerate(rows):
        # gate wide enough to reach both tails of the sigmoid
        gate = random_array((b, n, f), shapes.dtype, seed + 2 * i, scale=6.0)
        out.append(Case(f"{label} F={f}", (gate, random_array((b, n, f), shapes.dtype, seed + 2 * i + 1))))
    return out


KERNELS: dict[str, Kernel] = {"cpu": Kernel(silu_mul_cpu_kernel, lambda s: cpu_ext.supports(s, _DTYPES))}

OP = KernelOp(
    name="silu_mul", reference=silu_mul_ref, kernels=KERNELS,
    check_cases=lambda s: _cases(s, row_shapes(s), 30), timing_cases=lambda s: _cases(s, timing_rows(s), 40),
    tolerances=TOLERANCES,
)  # fmt: skip
