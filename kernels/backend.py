"""What every kernel shares: which back-end runs, one kernel text for Metal and CUDA, a cached builder.

Back-ends (`kernel_backend()`):
  "metal", "cuda"  `mx.fast.metal_kernel` / `mx.fast.cuda_kernel`, built from ONE body text per kernel; a
                   per-back-end prelude (MLX passes it as the kernel's `header`) maps the names below
  "cpu"            primitives of trillm's MLX C++ extension (kernels/cpu_ext.py); where it cannot be built or
                   loaded, each op's "cpu" kernel says so (`cpu_ext.supports`) and the op runs its reference
  None             TRILLM_KERNELS=ref: every op runs its pure-mx reference

Names a shared body may use:
  thread_position_in_threadgroup.x, threadgroup_position_in_grid.{x,y,z}, thread_position_in_grid,
  thread_index_in_simdgroup, simdgroup_index_in_threadgroup    thread indices (Metal's own names)
  simd_sum(x), simd_max(x)        reductions over one 32-wide simdgroup/warp
  SHARED, BARRIER()               threadgroup / __shared__ storage and its barrier
  UNROLL                          "unroll this loop fully": per-lane arrays stay in registers only then
  EXPF, MAXF, MINF, MINI, MAXI, NEG_INF, SOFTCAP(s, cap, 1 / cap)   math helpers
  RINTF(x), DIV_RN(a, b)          round half to even, and a / b correctly rounded even under fast math
                                  (the int8 quantize-on-write must match the pure-mx reference exactly)
Metal's index attributes exist only as parameters MLX adds for the names it finds in the BODY text, so a
kernel's `header` must not use them (KernelSpec refuses one that does); CUDA's prelude defines them as
macros over threadIdx/blockIdx.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, Literal

import mlx.core as mx

from trillm.kernels.layout import ModelShapes

Backend = Literal["metal", "cuda", "cpu"]

FORCE_REF_ENV = "TRILLM_KERNELS"  # TRILLM_KERNELS=ref forces the references everywhere


def cuda_available() -> bool:
    """True when this MLX build has a usable CUDA back-end."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def forced_reference() -> bool:
    return os.environ.get(FORCE_REF_ENV, "").lower() == "ref"


def kernel_backend() -> Backend | None:
    """The kernel back-end of the current default device, or None when the references are forced.

    Read on every call (cheap), so a test or the engine can switch device or environment at run time.
    """
    if forced_reference():
        return None
    if mx.default_device() != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if cuda_available():
        return "cuda"
    return None


@cache
def gpu_backend() -> Backend:
    """This MLX build's GPU back-end, for the one entry point the "metal" and "cuda" kernels of an op share."""
    return "metal" if mx.metal.is_available() else "cuda"


# ---------------------------------------------------------------- one source, two GPU back-ends
COMMON_PRELUDE = """
#define MAXF(a, b) ((a) > (b) ? (a) : (b))
#define MINI(a, b) ((a) < (b) ? (a) : (b))
#define MAXI(a, b) ((a) > (b) ? (a) : (b))
#define MINF(a, b) ((a) < (b) ? (a) : (b))
// A finite stand-in for -inf: exp(NEG_INF - NEG_INF) stays 1 instead of NaN, so fast math is safe.
#define NEG_INF (-1.0e30f)
// Logit soft-capping, cap * tanh(s / cap), as 1 - 2 / (exp(2y) + 1) on y clamped to [-9, 9] (tanh(9) is 1
// in float32): only EXPF, so every back-end (and the stand-ins) spell it alike, and no inf under fast math.
#define SOFTCAP(s, cap, inv_cap) \
  ((cap) * (1.0f - 2.0f / (EXPF(2.0f * MINF(MAXF((s) * (inv_cap), -9.0f), 9.0f)) + 1.0f)))
"""

METAL_PRELUDE = COMMON_PRELUDE + """
// threadgroup_barrier, mem_flags, simd_sum and simd_max live in namespace metal. MLX's utils header (which
// precedes every custom kernel) happens to say `using namespace metal;`; say it here rather than rely on it.
using namespace metal;
#define SHARED threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define UNROLL _Pragma("clang loop unroll(full)")
#define EXPF(x) metal::exp(x)
#define RINTF(x) metal::rint(x)
#define DIV_RN(a, b) metal::precise::divide(a, b)
"""

CUDA_PRELUDE = """
#ifndef TRILLM_CUDA_PRELUDE
#define TRILLM_CUDA_PRELUDE
""" + COMMON_PRELUDE + """
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define UNROLL _Pragma("unroll")
#define EXPF(x) expf(x)
#define RINTF(x) rintf(x)
#define DIV_RN(a, b) __fdiv_rn(a, b)
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

# Back-end -> prelude. Tests add a CPU emulator's ("emulate"; tests/kernels/kernel_emulator.py).
PRELUDES: dict[str, str] = {"metal": METAL_PRELUDE, "cuda": CUDA_PRELUDE}

# The thread attributes MLX's Metal wrapper turns into kernel parameters when the body names them
# (mlx/backend/common/metal_kernel.cpp), with their Metal types.
METAL_ATTRIBUTES: dict[str, str] = {
    "dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint", "thread_index_in_quadgroup": "uint", "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint", "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3", "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3", "threads_per_grid": "uint3", "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}  # fmt: skip


def metal_attributes_in(text: str) -> list[str]:
    """The Metal thread attributes `text` names (MLX's own substring test), in MLX's order."""
    return [name for name in METAL_ATTRIBUTES if name in text]


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One kernel's shared source: its body is identical text on every GPU back-end."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    body: str
    header: str = ""  # extra shared helpers, after the back-end prelude

    def __post_init__(self) -> None:
        if named := metal_attributes_in(self.header):
            raise ValueError(f"kernel {self.name}: its header names {named}, which exist on Metal only in the body")


def header_for(backend: str, spec: KernelSpec) -> str:
    """The full header MLX receives for `spec` on `backend` (prelude + the kernel's shared helpers)."""
    return PRELUDES[backend] + spec.header


# Fast math is safe for these bodies: they never form inf or NaN (NEG_INF is finite).
METAL_COMPILE_OPTIONS: dict[str, str] = {"math_mode": "fast"}


def _metal_factory(**kwargs: Any) -> Any:
    return mx.fast.metal_kernel(**kwargs, compile_options=METAL_COMPILE_OPTIONS)


def _cuda_factory(**kwargs: Any) -> Any:
    return mx.fast.cuda_kernel(**kwargs)


# Back-end -> kernel constructor taking (name, input_names, output_names, source, header). Tests register
# a CPU emulator and a launch recorder here to run or inspect the shared bodies without a GPU.
FACTORIES: dict[str, Callable[..., Any]] = {"metal": _metal_factory, "cuda": _cuda_factory}


@cache
def build(backend: str, spec: KernelSpec) -> Any:
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


@lru_cache(maxsize=512)
def int32_params(*values: int) -> mx.array:
    """A small int32 parameter array, made once per distinct value tuple (the layers of a step share it).

    Padded to 8 elements: MLX's Metal wrapper passes inputs under 8 elements in the `constant` address space
    and compiles a second variant for them; padding keeps one variant whatever the batch size.
    """
    return mx.array(list(values) + [0] * (8 - len(values)), dtype=mx.int32)


@lru_cache(maxsize=64)
def float32_params(*values: float) -> mx.array:
    """As `int32_params`, for float parameters (the softmax scale)."""
    return mx.array(list(values) + [0.0] * (8 - len(values)), dtype=mx.float32)


def at_least_8(x: mx.array) -> mx.array:
    """x flattened, zero-padded to 8 elements if shorter (see `int32_params`)."""
    flat = x.reshape(-1)
    return flat if flat.size >= 8 else mx.concatenate([flat, mx.zeros((8 - flat.size,), dtype=x.dtype)])


# ---------------------------------------------------------------- what the self-check needs of an op
@dataclass(frozen=True, slots=True)
class Case:
    """One call of an op: positional and keyword arguments, and a label for messages."""

    label: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def always(_: ModelShapes) -> str | None:
    return None


def every_model(_: ModelShapes) -> bool:
    return True


def random_array(shape: tuple[int, ...], dtype: mx.Dtype, seed: int, scale: float = 1.0) -> mx.array:
    """Normal values for check and timing cases, reproducible per seed."""
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def row_shapes(shapes: ModelShapes) -> list[tuple[str, int, int]]:
    """(label, batch, tokens per row) of the activations a step feeds the ops outside attention: decode at
    batch 1 and 9 (past MLX's 8-element threshold), a short and a longer prefill chunk."""
    return [("decode B=1", 1, 1), ("decode B=9", 9, 1), ("prefill L=3", 1, 3),
            (f"prefill L={min(shapes.chunk, 67)}", 2, min(shapes.chunk, 67))]


def timing_rows(shapes: ModelShapes) -> list[tuple[str, int, int]]:
    """(label, batch, tokens per row) timed against the reference: decode at batch 1 and at the largest batch,
    one prefill chunk."""
    return [("decode B=1", 1, 1), (f"decode B={shapes.max_batch}", shapes.max_batch, 1),
            (f"prefill L={shapes.chunk}", 1, shapes.chunk)]


@dataclass(frozen=True, slots=True)
class Kernel:
    """One back-end's implementation of an op, with the same signature as the op's reference."""

    fn: Callable[..., Any]
    supports: Callable[[ModelShapes], str | None] = always  # why it cannot run these shapes, or None


@dataclass(frozen=True, slots=True)
class KernelOp:
    """An op as the dispatcher and the start-up self-check see it.

    `kernels` maps a back-end to its implementation ("metal" and "cuda" usually share one entry point).
    `check_cases` covers every kernel variant serving will launch for these shapes (it compiles them);
    `timing_cases` are the calls timed against the reference (decode at batch 1 and at the largest batch,
    one prefill chunk). Results must match the reference exactly when `exact`, else be finite and within
    `tolerances[dtype]` = (atol, rtol). `applies` says whether a model with these shapes uses the op at all
    (MLA attention only for MLA models); the self-check neither checks nor times an op that does not apply.
    """

    name: str
    reference: Callable[..., Any]
    kernels: dict[str, Kernel]
    check_cases: Callable[[ModelShapes], list[Case]]
    timing_cases: Callable[[ModelShapes], list[Case]]
    exact: bool = False
    tolerances: Mapping[mx.Dtype, tuple[float, float]] = field(default_factory=dict)
    applies: Callable[[ModelShapes], bool] = every_model
    # The phase of a call ("decode" / "prefill", as the timing cases' labels begin): set, the self-check
    # decides kernel vs reference per phase, and the selection routes each call by it.
    phase_of: Callable[..., str] | None = None
    # What runs where the kernel is not chosen, and what its timing is measured against (None: the
    # reference). Quantized matmuls fall back to MLX's own rather than dequantizing every weight per call.
    fallback: Callable[..., Any] | None = None

    @property
    def runs_instead(self) -> Callable[..., Any]:
        return self.fallback if self.fallback is not None else self.reference

    def kernel_for(self, backend: str | None, shapes: ModelShapes) -> Kernel | None:
        """The implementation to run on `backend` for `shapes`, or None for the reference."""
        kernel = self.kernels.get(backend) if backend is not None else None
        return kernel if kernel is not None and kernel.supports(shapes) is None else None
