"""y = x @ weight.T for the few rows of a decode step: the reference (BLAS through MLX), the CPU primitive and
the dispatcher.

MLX sends every matmul to cblas_sgemm, and for a handful of rows OpenBLAS 0.3.21 reads the weights well under
the memory bandwidth (platform notes: ~11 GB/s for one row, ~7 for 8-32). The CPU primitive
(kernels/cpu/linear.cpp) streams each weight row once per call for all rows, split across the cores: dot
products along K up to 8 rows, each weight element broadcast against all rows (transposed) from 9 to 32. It
wins up to `MAX_ROWS` rows (1.1-2x OpenBLAS at 9-32 rows on SmolLM2's shapes); past that OpenBLAS's packed
sgemm is as fast, so larger M (prefill) stays on BLAS.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import Case, Kernel, KernelOp, random_array
from trillm.kernels.layout import ModelShapes

MAX_ROWS = 32  # measured: 1.2-3x BLAS at 1-8 rows, 1.1-2.3x at 9-32, about even at 48-64


def linear_ref(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., K], weight [N, K] -> [..., N]."""
    return x @ weight.T


def linear_cpu(x: mx.array, weight: mx.array) -> mx.array:
    """`linear` as a primitive of trillm's CPU extension (float32, K a multiple of 16). Shapes as the reference."""
    out: mx.array = cpu_ext.require().linear(x, weight)
    return out


def cpu_supports(x: mx.array, weight: mx.array) -> bool:
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    return (
        x.dtype == mx.float32 and weight.dtype == mx.float32 and weight.ndim == 2 and x.ndim >= 1
        and x.shape[-1] == weight.shape[1] and x.shape[-1] % 16 == 0 and 0 < rows <= MAX_ROWS
    )  # fmt: skip


def linear_cpu_kernel(x: mx.array, weight: mx.array) -> mx.array:
    """The "cpu" kernel the self-check runs: the primitive up to MAX_ROWS rows, BLAS (the reference) past it."""
    return linear_cpu(x, weight) if cpu_supports(x, weight) else linear_ref(x, weight)


def linear(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T: the CPU primitive on CPU for up to MAX_ROWS rows, else the reference. Unchecked: the
    engine runs what its start-up self-check chose (`trillm.kernels.selfcheck`)."""
    return (linear_cpu_kernel if cpu_ext.enabled() else linear_ref)(x, weight)


# K summed in another order (16 lanes, then a tree) than BLAS's.
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {mx.float32: (1e-4, 1e-4)}


def _shapes_supported(shapes: ModelShapes) -> str | None:
    if shapes.hidden % 16:
        return f"hidden size {shapes.hidden} is not a multiple of 16"
    return cpu_ext.supports(shapes, (mx.float32,))


def _weights(shapes: ModelShapes, seed: int) -> list[tuple[str, mx.array]]:
    """The model's weight shapes, one layer's worth: stacked q/k/v (read as row slices of one buffer, as the
    engine lays them out), o, stacked gate/up and down."""
    h, f, kv = shapes.hidden, shapes.intermediate, shapes.num_kv_heads * shapes.head_dim
    dt = shapes.dtype
    packed = random_array((h + 2 * kv + 2 * f, h), dt, seed, scale=h**-0.5)  # one buffer, like the engine's
    return [("q/k/v", packed[: h + 2 * kv]), ("o", random_array((h, h), dt, seed + 1, scale=h**-0.5)),
            ("gate/up", packed[h + 2 * kv :]), ("down", random_array((h, f), dt, seed + 2, scale=f**-0.5))]


def _check_cases(shapes: ModelShapes) -> list[Case]:
    out = []
    for name, w in _weights(shapes, 70):
        for rows in sorted({1, 2, 3, 5, 8, 9, 16, 17, 24, min(shapes.max_batch, MAX_ROWS), MAX_ROWS, MAX_ROWS + 1}):
            x = random_array((rows, 1, w.shape[1]), shapes.dtype, 80 + rows)
            out.append(Case(f"{name} {tuple(w.shape)} rows={rows}", (x, w)))
    return out


STREAM_BYTES = 96 << 20  # cap of the timing weight: larger than the last-level caches of most CPUs


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    """Decode at batch 1 and at the most rows the primitive takes (past MAX_ROWS both run BLAS), on a weight
    shaped like the model's LM head (vocab x hidden, capped at 96 MB). A decode step streams every weight
    from memory once; on a weight the caches hold both sides are compute-bound and within noise of each
    other (seen here: a check on one layer's weights picked BLAS at 8 rows for SmolLM2, and the engine then
    ran its decode matmuls at half the speed). A tiny model's weights do stay in the caches, and so does
    its timing weight."""
    k = shapes.hidden
    n = max(48, min(shapes.vocab, STREAM_BYTES // (4 * k)) // 48 * 48)
    w = mx.full((n, k), k**-0.5, dtype=shapes.dtype)  # values do not change a matmul's speed; filling is quick
    return [Case(f"decode B={rows} {(n, k)}", (random_array((rows, 1, k), shapes.dtype, 95), w))
            for rows in sorted({1, min(shapes.max_batch, MAX_ROWS)})]


KERNELS: dict[str, Kernel] = {"cpu": Kernel(linear_cpu_kernel, _shapes_supported)}

OP = KernelOp(
    name="linear", reference=linear_ref, kernels=KERNELS, check_cases=_check_cases, timing_cases=_timing_cases,
    tolerances=TOLERANCES,
)  # fmt: skip
