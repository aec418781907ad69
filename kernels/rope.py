"""Rotary position embedding: the reference (`mx.fast.rope`), the CPU primitive and the dispatcher.

On CPU, MLX runs `mx.fast.rope` as its composite fallback (~20 ops per call: positions, frequencies,
cos, sin, slices, products, concatenation; two calls per layer). The CPU primitive (kernels/cpu/rope.cpp)
is one op that reads x through its strides, computes cos/sin once per position for every head, and writes
contiguous output.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import (
    Case, Kernel, KernelOp, random_array, row_shapes, timing_rows,
)  # fmt: skip
from trillm.kernels.layout import ModelShapes

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# Both compute the angle in float32, each in its own order: at position ~2k (the check's top) one ulp of
# the angle is 2.4e-4 rad, and the two may differ by two, times |x| (N(0, 1) inputs reach ~4.5) in an
# element the rotation can leave near zero, so rtol cannot carry it: atol 2e-3 (measured up to 5.2e-4; an
# off-by-one position or frequency is off by ~|x|).
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (2e-3, 2e-5), mx.float16: (4e-3, 4e-3), mx.bfloat16: (3e-2, 3e-2),
}  # fmt: skip
CHECK_MAX_POSITION = 2048


def rope_ref(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float,
             offset: int | mx.array) -> mx.array:  # fmt: skip
    """x [B, H, L, D] (or [B, L, D]); offset: the first position, one int or one per batch row."""
    return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)


def rope_cpu(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float,
             offset: int | mx.array) -> mx.array:  # fmt: skip
    """`rope` as a primitive of trillm's CPU extension. Shapes as the reference."""
    ext = cpu_ext.require()
    offsets = mx.array([offset], mx.int32) if isinstance(offset, int) else offset
    out: mx.array = ext.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offsets)
    return out


def _cpu_supports(x: mx.array, dims: int, offset: int | mx.array) -> bool:
    rows_ok = isinstance(offset, int) or offset.size == 1 or (offset.ndim == 1 and offset.shape[0] == x.shape[0])
    return x.ndim in (3, 4) and x.dtype in _DTYPES and dims % 2 == 0 and dims <= x.shape[-1] and rows_ok


def rope_cpu_kernel(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float,
                    offset: int | mx.array) -> mx.array:  # fmt: skip
    """The "cpu" kernel the self-check runs: the primitive, or the reference for a call it does not take."""
    fn = rope_cpu if _cpu_supports(x, dims, offset) else rope_ref
    return fn(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)


def rope(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float,
         offset: int | mx.array) -> mx.array:  # fmt: skip
    """RoPE (forward) of x: the CPU primitive on CPU, else the reference. Unchecked: the engine runs what its
    start-up self-check chose (`trillm.kernels.selfcheck`)."""
    fn = rope_cpu_kernel if cpu_ext.enabled() else rope_ref
    return fn(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)


def _cases(shapes: ModelShapes, rows: list[tuple[str, int, int]], seed: int, *, both: bool) -> list[Case]:
    """Queries and keys as mlx-lm's attention passes them (head-major views of [B, L, H, D]); one offset for
    the batch and one per row; both rotation layouts when `both`."""
    d = shapes.head_dim
    top = min(shapes.max_context, CHECK_MAX_POSITION)
    out = []
    for i, (label, b, n) in enumerate(rows):
        for heads in (shapes.num_q_heads, shapes.num_kv_heads):
            x = random_array((b, n, heads, d), shapes.dtype, seed + i).transpose(0, 2, 1, 3)
            ragged = mx.array([(37 * r + top - n) % (top - n + 1) for r in range(b)], mx.int32)
            for traditional in (False, True) if both else (False,):
                for offset in (max(0, top - n), ragged):
                    kind = "per-row offsets" if isinstance(offset, mx.array) else f"offset {offset}"
                    kw = dict(traditional=traditional, base=10000.0, scale=1.0, offset=offset)
                    out.append(Case(f"{label} H={heads} {kind}{' traditional' if traditional else ''}", (x, d), kw))
            if not both:
                break  # time the query heads alone
    return out


KERNELS: dict[str, Kernel] = {"cpu": Kernel(rope_cpu_kernel, lambda s: cpu_ext.supports(s, _DTYPES))}

OP = KernelOp(
    name="rope", reference=rope_ref, kernels=KERNELS,
    check_cases=lambda s: _cases(s, row_shapes(s), 50, both=True),
    timing_cases=lambda s: _cases(s, timing_rows(s), 60, both=False), tolerances=TOLERANCES,
)  # fmt: skip
