"""The gated delta rule (Qwen3-Next / Qwen3.5 linear attention): the reference, the CPU primitive and the
dispatcher.

Per value head, a state S [Dv, Dk] (float32) and per token, with the head's decay g (a scalar, or one per key
channel), beta, and its key head's q and k (GQA: value head hv reads key head hv // (Hv // Hk)):

    S = S * g;  delta = (v - S @ k) * beta;  S = S + delta k^T;  y = S @ q

as mlx-lm's `gated_delta_ops` (models/gated_delta.py), which its `gated_delta_update` runs everywhere but on
Metal: a masked token (right padding) leaves S as it was (its y is computed all the same); y in q's dtype,
the state float32. On CPU that is seven full-state ops per token, a per-token loop for prefill, on one thread
(89% of a batch-16 decode step of a Qwen3.5-shaped model); the CPU primitive (kernels/cpu/gated_delta.cpp)
runs each state row through all T tokens in registers, rows split across the cores. On Metal and CUDA one
shared body (`DELTA`): a 32-lane simdgroup per state row, each lane holding Dk / 32 of its floats in
registers over all T tokens (mlx-lm's own Metal kernel's layout, written here for both back-ends); Dk a
multiple of 32, else the reference. Where the self-check does not choose a kernel (no kernel for the
back-end, or it lost or mismatched), the engine runs mlx-lm's own `gated_delta_update` (its Metal kernel on
Metal).

The engine routes the model's own `gated_delta_update` here (engine/fused_ops.py); g and beta are computed
there as mlx-lm does, so the op takes them ready.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import (
    Case, Kernel, KernelOp, KernelSpec, at_least_8, build, gpu_backend, int32_params, random_array,
)  # fmt: skip
from trillm.kernels.backend import kernel_backend
from trillm.kernels.layout import ModelShapes

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# The primitive sums the dot products in another order; y is rounded to the input dtype (one ulp apart).
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (1e-4, 1e-4), mx.float16: (4e-3, 4e-3), mx.bfloat16: (3e-2, 3e-2),
}  # fmt: skip


class GatedDeltaFn(Protocol):
    def __call__(self, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                 mask: mx.array | None = None) -> tuple[mx.array, mx.array]: ...  # fmt: skip


def _step_ops(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
          mask: mx.array | None) -> tuple[mx.array, mx.array]:
    """One token: q, k [B, H, Dk] (already repeated to the value heads), v [B, H, Dv], g [B, H] or [B, H, Dk],
    beta [B, H], state [B, H, Dv, Dk], mask [B] or None."""
    decay = g[..., None, None] if g.ndim == 2 else g[..., None, :]
    new = state * decay
    kv = (new * k[..., None, :]).sum(axis=-1)
    delta = (v - kv) * beta[..., None]
    new = new + k[..., None, :] * delta[..., None]
    y = (new * q[..., None, :]).sum(axis=-1)
    if mask is not None:
        new = mx.where(mask[:, None, None, None], new, state)
    return y.astype(q.dtype), new


# Compiled, as mlx-lm's own step: what the kernel is timed against is mlx-lm's ops path, not a slower one.
_step = mx.compile(_step_ops)


def gated_delta_ref(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                    mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv] or [B, T, Hv, Dk]; beta [B, T, Hv]; state [B, Hv,
    Dv, Dk]; mask bool [B, T] or None -> (y [B, T, Hv, Dv] in q's dtype, new state), token by token."""
    if (rep := v.shape[2] // k.shape[2]) > 1:
        q = mx.repeat(q, rep, axis=2)
        k = mx.repeat(k, rep, axis=2)
    ys = []
    for t in range(q.shape[1]):
        y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t])
        ys.append(y)
    return mx.stack(ys, axis=1), state


def gated_delta_cpu(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                    mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """`gated_delta` as a primitive of trillm's CPU extension. Shapes as the reference."""
    y, new = cpu_ext.require().gated_delta(q, k, v, g, beta, state, mask)
    return y, new


def _takes_call(q: mx.array, k: mx.array, v: mx.array, g: mx.array, state: mx.array) -> bool:
    B, T, Hk, Dk = q.shape
    return (q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype and state.dtype == mx.float32
            and g.dtype == mx.float32 and Hk > 0 and v.shape[2] % Hk == 0)  # fmt: skip


def gated_delta_cpu_kernel(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                           mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The "cpu" kernel the self-check runs: the primitive, or the reference for a call it does not take
    (a state or gate not in float32: the reference's type promotion decides what it returns)."""
    if _takes_call(q, k, v, g, state):
        return gated_delta_cpu(q, k, v, g, beta, state, mask)
    return gated_delta_ref(q, k, v, g, beta, state, mask)


def gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The gated delta rule over T tokens: the CPU primitive on CPU, else the reference. Unchecked: the
    engine runs what its start-up self-check chose (`trillm.kernels.selfcheck`)."""
    return (gated_delta_cpu_kernel if cpu_ext.enabled() else gated_delta_ref)(q, k, v, g, beta, state, mask)


# Template: InT (q, k, v, y), Dk, Dv, Hk, Hv, VEC_G (g [B, T, Hv, Dk], else [B, T, Hv]), HAS_MASK. Inputs g,
# beta, state_in float32; mask int32 [B * T] (a dummy without HAS_MASK); params: [T]. Grid (32, Dv, B * Hv),
# threadgroups of 32: one simdgroup per state row (b, hv, dv), lane l holding its floats l * NPT .. + NPT.
_DELTA_BODY = """
  constexpr int NPT = Dk / 32;
  const int T = params[0];
  const int n = thread_position_in_grid.z;
  const int b = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int lane = thread_position_in_threadgroup.x;
  const int dv = thread_position_in_grid.y;
  const int row = (n * Dv + dv) * Dk + lane * NPT;
  float st[NPT];
  float ns[NPT];
  UNROLL for (int i = 0; i < NPT; ++i) st[i] = state_in[row + i];
  for (int t = 0; t < T; ++t) {
    const int bt = b * T + t;
    const int sh = bt * Hv + hv;
    const int qk = (bt * Hk + hk) * Dk + lane * NPT;
    float kv = 0.0f;
    UNROLL for (int i = 0; i < NPT; ++i) {
      ns[i] = st[i] * (VEC_G ? g[sh * Dk + lane * NPT + i] : g[sh]);
      kv += ns[i] * static_cast<float>(k[qk + i]);
    }
    kv = simd_sum(kv);
    const float delta = (static_cast<float>(v[sh * Dv + dv]) - kv) * beta[sh];
    // A masked token (right padding) leaves the state as it was; its y is computed all the same (mlx-lm's ops).
    const bool keep = !HAS_MASK || mask[bt] != 0;
    float out = 0.0f;
    UNROLL for (int i = 0; i < NPT; ++i) {
      ns[i] += static_cast<float>(k[qk + i]) * delta;
      out += ns[i] * static_cast<float>(q[qk + i]);
      if (keep) st[i] = ns[i];
    }
    out = simd_sum(out);
    if (lane == 0) y[sh * Dv + dv] = static_cast<InT>(out);
  }
  UNROLL for (int i = 0; i < NPT; ++i) state_out[row + i] = st[i];
"""
DELTA = KernelSpec("gated_delta", ("q", "k", "v", "g", "beta", "state_in", "mask", "params"), ("y", "state_out"),
                   _DELTA_BODY)


def gated_delta_kernel(backend: str, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                       state: mx.array, mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Launch the shared body on `backend` (any name in backend.FACTORIES). Shapes as the reference; Dk a
    multiple of 32."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if Dk % 32 or Hv % Hk:
        raise ValueError(f"the GPU kernel needs Dk a multiple of 32 and Hv a multiple of Hk, got {Dk}, {Hv}/{Hk}")
    f32 = mx.float32
    flags = at_least_8(mask.reshape(-1).astype(mx.int32)) if mask is not None else int32_params(0)
    outs: list[mx.array] = build(backend, DELTA)(
        inputs=[q, k, v, g.astype(f32), beta.astype(f32), state.astype(f32), flags, int32_params(T)],
        template=[("InT", q.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv), ("VEC_G", g.ndim == 4),
                  ("HAS_MASK", mask is not None)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 1, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)], output_dtypes=[q.dtype, f32],
    )  # fmt: skip
    return outs[0], outs[1]


def gated_delta_gpu(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                    mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """`gated_delta` as this GPU's kernel (Metal or CUDA), or the reference for a call it does not take."""
    if q.shape[3] % 32 or not _takes_call(q, k, v, g, state):
        return gated_delta_ref(q, k, v, g, beta, state, mask)
    return gated_delta_kernel(gpu_backend(), q, k, v, g, beta, state, mask)


def _gpu_supports(shapes: ModelShapes) -> str | None:
    if shapes.dtype not in _DTYPES:
        return f"dtype {shapes.dtype} is not float32/float16/bfloat16"
    if shapes.delta_net and shapes.delta_net[2] % 32:
        return f"key head dim {shapes.delta_net[2]} is not a multiple of 32"
    return None


def _case(label: str, shapes: ModelShapes, b: int, t: int, seed: int, vector_gate: bool = False,
          ragged: bool = False) -> Case:
    hk, hv, dk, dv = shapes.delta_net
    dtype = shapes.dtype
    # q, k unit-norm per head (mlx-lm's normalize_qk), q scaled by Dk^-0.5, as the model feeds them.
    q = random_array((b, t, hk, dk), mx.float32, seed)
    k = random_array((b, t, hk, dk), mx.float32, seed + 1)
    q = (q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * dk**-0.5).astype(dtype)
    k = (k * mx.rsqrt((k * k).sum(-1, keepdims=True))).astype(dtype)
    v = random_array((b, t, hv, dv), dtype, seed + 2)
    gshape = (b, t, hv, dk) if vector_gate else (b, t, hv)
    g = mx.exp(-mx.abs(random_array(gshape, mx.float32, seed + 3, scale=0.3)))
    beta = mx.sigmoid(random_array((b, t, hv), dtype, seed + 4))
    state = random_array((b, hv, dv, dk), mx.float32, seed + 5, scale=0.5)
    mask = None
    if ragged:
        lengths = mx.array([t - (i % 3) for i in range(b)])
        mask = mx.arange(t)[None, :] < lengths[:, None]
    return Case(f"{label} B={b} T={t}" + (" vector gate" if vector_gate else "") + (" ragged" if ragged else ""),
                (q, k, v, g, beta, state, mask))


def _check_cases(shapes: ModelShapes) -> list[Case]:
    t = min(shapes.chunk, 67)
    return [_case("decode", shapes, 1, 1, 60), _case("decode", shapes, 9, 1, 70),
            _case("prefill", shapes, 1, 3, 80, vector_gate=True), _case("prefill", shapes, 3, t, 90, ragged=True)]


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    # The reference's prefill is a loop of per-token ops: a long chunk would make the start-up check slow.
    return [_case("decode", shapes, 1, 1, 100), _case("decode", shapes, shapes.max_batch, 1, 110),
            _case("prefill", shapes, 1, min(shapes.chunk, 128), 120)]


def _phase(q: mx.array, *_: object, **__: object) -> str:
    return "decode" if q.shape[1] == 1 else "prefill"


def _supports(shapes: ModelShapes) -> str | None:
    return cpu_ext.supports(shapes, _DTYPES)


KERNELS: dict[str, Kernel] = {"cpu": Kernel(gated_delta_cpu_kernel, _supports),
                               "metal": Kernel(gated_delta_gpu, _gpu_supports),
                               "cuda": Kernel(gated_delta_gpu, _gpu_supports)}


def mlx_lm_own(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
               mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """What mlx-lm's gated_delta_update runs for these inputs: its Metal kernel on Metal (Dk a multiple of 32),
    else its ops (the reference). What a kernel is timed against, and what runs where it is not chosen."""
    if kernel_backend() == "metal" and q.shape[3] % 32 == 0:
        from mlx_lm.models import gated_delta as mlx_gdn

        if (own := getattr(mlx_gdn, "gated_delta_kernel", None)) is not None:
            y, new = own(q, k, v, g, beta, state, mask)
            return y, new
    return gated_delta_ref(q, k, v, g, beta, state, mask)


OP = KernelOp(
    name="gated_delta", reference=gated_delta_ref, kernels=KERNELS, check_cases=_check_cases,
    timing_cases=_timing_cases, tolerances=TOLERANCES, applies=lambda s: bool(s.delta_net), phase_of=_phase,
    fallback=mlx_lm_own,
)  # fmt: skip
