"""y = x @ weight.T for the few rows of a decode step: the reference (BLAS through MLX), the CPU primitive and
the dispatcher.

MLX sends every matmul to cblas_sgemm, and for a handful of rows OpenBLAS 0.3.21 reads the weights well under
the memory bandwidth (platform notes: ~11 GB/s for one row, ~7 for 8-32). The CPU primitive
(kernels/cpu/linear.cpp) streams each weight row once per call for all rows, split across the cores. It wins
up to `MAX_ROWS` rows; past that OpenBLAS's packed sgemm is faster, so larger M stays on BLAS.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels import cpu_ext

MAX_ROWS = 8  # measured: ~2-4x BLAS at 1-4 rows, about even at 8-13, slower at 32


def linear_ref(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., K], weight [N, K] -> [..., N]."""
    return x @ weight.T


def linear_cpu(x: mx.array, weight: mx.array) -> mx.array:
    """`linear` as a primitive of trillm's CPU extension (float32, K a multiple of 16). Shapes as the reference."""
    ext = cpu_ext.load()
    if ext is None:
        raise RuntimeError(f"trillm's CPU extension is unavailable: {cpu_ext.status().reason}")
    out: mx.array = ext.linear(x, weight)
    return out


def cpu_supports(x: mx.array, weight: mx.array) -> bool:
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    return (
        x.dtype == mx.float32 and weight.dtype == mx.float32 and weight.ndim == 2 and x.ndim >= 1
        and x.shape[-1] == weight.shape[1] and x.shape[-1] % 16 == 0 and 0 < rows <= MAX_ROWS
    )  # fmt: skip


def linear(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T: the CPU primitive on CPU for up to MAX_ROWS rows, else the reference."""
    if cpu_ext.enabled() and cpu_supports(x, weight) and cpu_ext.load() is not None:
        return linear_cpu(x, weight)
    return linear_ref(x, weight)
