"""The depthwise causal convolution of recurrent mixers (Mamba-2, Nemotron-H, Falcon-H1, Qwen3.5/Qwen3-Next's
delta nets, LFM2): the reference, the CPU kernel, the shared Metal/CUDA body and the dispatcher.

The model's `nn.Conv1d(C, C, K, groups=C, padding=0)` on its window-padded input x [B, L + K - 1, C]:

    y[b, t, c] = bias[c] + sum_k weight[c, k, 0] * x[b, t + k, c]

MLX's CPU conv1d takes no shortcut for groups == channels: 164 ms a layer on a [16, 47, 6144] prefill input
(a batch of 16 chat prompts on a Mamba-2 model), 1.65 ms on a batch-16 decode window [16, 4, 6144]. The
CPU kernel is the sum above as K shifted views (no copy) multiplied by their tap and added, in one compiled,
shapeless elementwise pass (float32 inside, rounded once): 5-10 ms and 0.2 ms there. On Metal and CUDA one
shared body (`CONV`) computes the same sum, one thread per output element, a threadgroup's lanes on consecutive
channels (the taps stored tap-major so their reads coalesce too). Compiled (Metal stand-in, nvcc) and emulated
only: never run on a GPU; there, as everywhere, the start-up self-check keeps MLX's own conv unless the kernel
matches it and wins.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from trillm.kernels.backend import (
    Case, Kernel, KernelOp, KernelSpec, build, gpu_backend, int32_params, kernel_backend, random_array,
)  # fmt: skip
from trillm.kernels.layout import ModelShapes

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# The taps summed in float32 in another order than MLX's conv; y rounded once to its dtype.
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (1e-5, 1e-5), mx.float16: (4e-3, 4e-3), mx.bfloat16: (3e-2, 3e-2),
}  # fmt: skip


def depthwise_conv1d_ref(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x [B, L + K - 1, C], weight [C, K, 1], bias [C] or None -> y [B, L, C]: MLX's conv1d, as nn.Conv1d."""
    y = mx.conv1d(x, weight, groups=weight.shape[0])
    return y + bias if bias is not None else y


def _taps(*args: mx.array) -> mx.array:
    # args: K shifted views of x, K taps [C], then the bias [C] when there is one.
    k = len(args) // 2
    y = args[0].astype(mx.float32) * args[k]
    for i in range(1, k):
        y = y + args[i].astype(mx.float32) * args[k + i]
    if len(args) % 2:
        y = y + args[-1]
    return y.astype(args[0].dtype)


# Shapeless: a prefill's length changes every call; the shifted views are sliced outside.
_taps_compiled = mx.compile(_taps, shapeless=True)


def _takes_call(x: mx.array, weight: mx.array, bias: mx.array | None) -> bool:
    C = weight.shape[0]
    return (x.ndim == 3 and weight.ndim == 3 and weight.shape[2] == 1 and x.shape[2] == C
            and x.shape[1] >= weight.shape[1] and x.dtype in _DTYPES and weight.dtype == x.dtype
            and (bias is None or (bias.shape == (C,) and bias.dtype == x.dtype)))  # fmt: skip


def depthwise_conv1d_taps(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """The kernel: the taps' sum over shifted views (see the module docstring), or the reference for a call
    it does not take. Shapes as the reference."""
    if not _takes_call(x, weight, bias):
        return depthwise_conv1d_ref(x, weight, bias)
    K = weight.shape[1]
    L = x.shape[1] - K + 1
    f32 = mx.float32
    views = [x[:, k : k + L] for k in range(K)]
    taps = [weight[:, k, 0].astype(f32) for k in range(K)]
    extra = [bias.astype(f32)] if bias is not None else []
    out: mx.array = _taps_compiled(*views, *taps, *extra)
    return out


# Template: InT (x, y), K, HAS_BIAS. Inputs x [B, L + K - 1, C], taps [K, C] and bias [C] float32 (a dummy
# without HAS_BIAS), params int32 (C, L). Grid (C rounded up to the threadgroup, L, B): one thread an output.
_CONV_BODY = """
  const int C = params[0];
  const int L = params[1];
  const int c = thread_position_in_grid.x;
  const int t = thread_position_in_grid.y;
  const int b = thread_position_in_grid.z;
  if (c >= C) return;
  const int in0 = (b * (L + K - 1) + t) * C + c;
  float acc = 0.0f;
  UNROLL for (int k = 0; k < K; ++k) acc += static_cast<float>(x[in0 + k * C]) * taps[k * C + c];
  if (HAS_BIAS) acc += bias[c];
  y[(b * L + t) * C + c] = static_cast<InT>(acc);
"""
CONV = KernelSpec("depthwise_conv1d", ("x", "taps", "bias", "params"), ("y",), _CONV_BODY)
_THREADS = 256


def depthwise_conv1d_kernel(backend: str, x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """Launch the shared body on `backend` (any name in backend.FACTORIES). Shapes as the reference."""
    b, n, C = x.shape
    K = weight.shape[1]
    L = n - K + 1
    f32 = mx.float32
    tg = min(_THREADS, C)
    outs: list[mx.array] = build(backend, CONV)(
        inputs=[x, weight[:, :, 0].T.astype(f32), bias.astype(f32) if bias is not None else int32_params(0),
                int32_params(C, L)],
        template=[("InT", x.dtype), ("K", K), ("HAS_BIAS", bias is not None)],
        grid=(-(-C // tg) * tg, L, b), threadgroup=(tg, 1, 1),
        output_shapes=[(b, L, C)], output_dtypes=[x.dtype],
    )  # fmt: skip
    return outs[0]


def depthwise_conv1d_gpu(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """The convolution as this GPU's kernel (Metal or CUDA), or the reference for a call it does not take."""
    if not _takes_call(x, weight, bias):
        return depthwise_conv1d_ref(x, weight, bias)
    return depthwise_conv1d_kernel(gpu_backend(), x, weight, bias)


def depthwise_conv1d(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """The depthwise convolution: the taps on CPU, the shared body on Metal/CUDA, else the reference.
    Unchecked: the engine runs what its start-up self-check chose (`trillm.kernels.selfcheck`)."""
    backend = kernel_backend()
    fn = (depthwise_conv1d_taps if backend == "cpu" else depthwise_conv1d_gpu if backend in ("metal", "cuda")
          else depthwise_conv1d_ref)  # fmt: skip
    return fn(x, weight, bias)


def _case(label: str, shapes: ModelShapes, b: int, length: int, seed: int, bias: bool = True) -> Case:
    C, K = shapes.conv
    dtype = shapes.dtype
    x = random_array((b, length + K - 1, C), dtype, seed)
    w = random_array((C, K, 1), dtype, seed + 1, scale=0.5)
    args: tuple[Any, ...] = (x, w, random_array((C,), dtype, seed + 2)) if bias else (x, w)
    return Case(f"{label} C={C} K={K}" + ("" if bias else " no bias"), args)


def _check_cases(shapes: ModelShapes) -> list[Case]:
    n = min(shapes.chunk, 67)
    return [_case("decode B=1", shapes, 1, 1, 10), _case("decode B=9", shapes, 9, 1, 20, bias=False),
            _case("prefill L=3", shapes, 1, 3, 30), _case(f"prefill L={n}", shapes, 2, n, 40)]


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    # A prefill chunk of at most 256 tokens: MLX's conv at a 2,048-token chunk takes about 0.5 s a call.
    n = min(shapes.chunk, 256)
    b = shapes.max_batch
    return [_case("decode B=1", shapes, 1, 1, 50), _case(f"decode B={b}", shapes, b, 1, 60),
            _case(f"prefill L={n}", shapes, 1, n, 70)]


def _supports(shapes: ModelShapes) -> str | None:
    return None if shapes.dtype in _DTYPES else f"dtype {shapes.dtype} is not float32/float16/bfloat16"


KERNELS: dict[str, Kernel] = {"cpu": Kernel(depthwise_conv1d_taps, _supports),
                               "metal": Kernel(depthwise_conv1d_gpu, _supports),
                               "cuda": Kernel(depthwise_conv1d_gpu, _supports)}

OP = KernelOp(
    name="depthwise_conv1d", reference=depthwise_conv1d_ref, kernels=KERNELS, check_cases=_check_cases,
    timing_cases=_timing_cases, tolerances=TOLERANCES, applies=lambda s: bool(s.conv),
)  # fmt: skip
