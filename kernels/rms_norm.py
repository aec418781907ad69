"""RMSNorm over the last axis: the reference (`mx.fast.rms_norm`), the CPU primitive and the dispatcher.

On CPU, MLX runs `mx.fast.rms_norm` as its composite fallback (square, mean, add, rsqrt, two multiplies:
six ops per norm, two norms per layer); the CPU primitive (kernels/cpu/rms_norm.cpp) is one pass per row.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import (
    Case, Kernel, KernelOp, random_array, row_shapes, timing_rows,
)  # fmt: skip
from trillm.kernels.layout import ModelShapes

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# The primitive sums the squares in another order (and in fp32 for every dtype).
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (2e-5, 2e-5), mx.float16: (4e-3, 4e-3), mx.bfloat16: (3e-2, 3e-2),
}  # fmt: skip


def rms_norm_ref(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x [..., D], weight [D] -> x * rsqrt(mean(x^2, -1) + eps) * weight, in x's dtype."""
    return mx.fast.rms_norm(x, weight, eps)


def rms_norm_cpu(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`rms_norm` as a primitive of trillm's CPU extension. Shapes as the reference."""
    out: mx.array = cpu_ext.require().rms_norm(x, weight, eps)
    return out


def _cpu_supports_call(x: mx.array, weight: mx.array) -> bool:
    return x.dtype in _DTYPES and weight.ndim == 1 and x.ndim >= 1 and weight.shape[0] == x.shape[-1]


def rms_norm_cpu_kernel(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """The "cpu" kernel the self-check runs: the primitive, or the reference for a call it does not take."""
    return rms_norm_cpu(x, weight, eps) if _cpu_supports_call(x, weight) else rms_norm_ref(x, weight, eps)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """RMSNorm of x [..., D] with weight [D]: the CPU primitive on CPU, else the reference. Unchecked: the
    engine runs what its start-up self-check chose (`trillm.kernels.selfcheck`)."""
    return (rms_norm_cpu_kernel if cpu_ext.enabled() else rms_norm_ref)(x, weight, eps)


def _cases(shapes: ModelShapes, rows: list[tuple[str, int, int]], seed: int) -> list[Case]:
    d = shapes.hidden
    out = []
    for i, (label, b, n) in enumerate(rows):
        x = random_array((b, n, d), shapes.dtype, seed + 2 * i, scale=3.0)
        w = random_array((d,), shapes.dtype, seed + 2 * i + 1)
        out.append(Case(f"{label} D={d}", (x, w, 1e-5)))
    return out


KERNELS: dict[str, Kernel] = {"cpu": Kernel(rms_norm_cpu_kernel, lambda s: cpu_ext.supports(s, _DTYPES))}

OP = KernelOp(
    name="rms_norm", reference=rms_norm_ref, kernels=KERNELS,
    check_cases=lambda s: _cases(s, row_shapes(s), 10), timing_cases=lambda s: _cases(s, timing_rows(s), 20),
    tolerances=TOLERANCES,
)  # fmt: skip
