"""One kernel source, two back-ends: per-back-end preludes and a cached builder for `mx.fast` kernels.

Kernel bodies are written once against the names below; the prelude (passed to MLX as the kernel's
`header`) maps them onto Metal or CUDA:
  thread_position_in_threadgroup.x, threadgroup_position_in_grid.{x,y,z},
  thread_index_in_simdgroup, simdgroup_index_in_threadgroup    thread indices (Metal's own names)
  simd_sum(x), simd_max(x)                                      reductions over one 32-wide simdgroup/warp
  SHARED                                                        threadgroup / __shared__ storage
  BARRIER()                                                     threadgroup barrier
  EXPF, MAXF, MINI, MAXI, NEG_INF                               math helpers
Metal names the index attributes in the body itself (MLX only adds the ones it finds in the body text);
CUDA's prelude defines them as macros over threadIdx/blockIdx.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

import mlx.core as mx

from trillm.kernels._dispatch import Backend

COMMON_PRELUDE = """
#define MAXF(a, b) ((a) > (b) ? (a) : (b))
#define MINI(a, b) ((a) < (b) ? (a) : (b))
#define MAXI(a, b) ((a) > (b) ? (a) : (b))
// A finite stand-in for -inf: exp(NEG_INF - NEG_INF) stays 1 instead of NaN.
#define NEG_INF (-1.0e30f)
"""

METAL_PRELUDE = COMMON_PRELUDE + """
#define SHARED threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define EXPF(x) metal::exp(x)
"""

CUDA_PRELUDE = """
#ifndef TRILLM_CUDA_PRELUDE
#define TRILLM_CUDA_PRELUDE
""" + COMMON_PRELUDE + """
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define EXPF(x) expf(x)
#define thread_position_in_threadgroup threadIdx
#define threadgroup_position_in_grid blockIdx
#define thread_position_in_grid \\
  make_uint3(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, \\
             blockIdx.z * blockDim.z + threadIdx.z)
#define thread_index_in_simdgroup (threadIdx.x & 31u)
#define simdgroup_index_in_threadgroup (threadIdx.x >> 5)
__device__ __forceinline__ float simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
#endif  // TRILLM_CUDA_PRELUDE
"""

PRELUDES: dict[str, str] = {"metal": METAL_PRELUDE, "cuda": CUDA_PRELUDE}


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One kernel's shared source: its body is identical text on both back-ends."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    body: str
    header: str = ""  # extra shared helpers, after the back-end prelude


def header_for(backend: Backend, spec: KernelSpec) -> str:
    """The full header MLX receives for `spec` on `backend` (prelude + the kernel's shared helpers)."""
    return PRELUDES[backend] + spec.header


def _metal_factory(**kwargs: Any) -> Any:
    return mx.fast.metal_kernel(**kwargs)


def _cuda_factory(**kwargs: Any) -> Any:
    return mx.fast.cuda_kernel(**kwargs)


# Back-end -> kernel constructor taking (name, input_names, output_names, source, header). Tests register
# a CPU emulator here (tests/kernels/kernel_emulator.py) to run the shared bodies without a GPU.
FACTORIES: dict[str, Callable[..., Any]] = {"metal": _metal_factory, "cuda": _cuda_factory}


@cache
def build(backend: Backend, spec: KernelSpec) -> Any:
    """Construct the `mx.fast` kernel for `spec` once per back-end and cache it.

    Lazy: `mx.fast.cuda_kernel` raises at construction on a build without CUDA.
    """
    return FACTORIES[backend](
        name=f"trillm_{spec.name}",
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.body,
        header=header_for(backend, spec),
    )
