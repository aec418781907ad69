"""Mamba-2's state-space update (Mamba-2, Nemotron-H, Falcon-H1), for one token (decode) and over a prompt's
tokens (prefill): the reference, the CPU primitive, the shared Metal/CUDA body and the dispatcher.

Per head h a state [Dh, Ds] (float32) and, with dt already softplus'd and clipped (mlx-lm's `compute_dt`),
A = -exp(A_log) and head h reading group h // (H // G) of B and C, token by token:

    dA = exp(dt * A);  state = dA * state + (dt * x) B^T;  y = state . C + D * x

as mlx-lm's `ssm_attn`, the path its `ssm_update` runs everywhere but for decode on Metal. At seq_len 1 that is a
dozen small ops and full-state passes (66-75% of a batch-16 decode step of a Mamba-2 model on CPU); over L
tokens it is SSD's quadratic form in chunks of 256 (an [L, L] decay matrix and C B^T per head: 56% of a
512-token Mamba-2 prefill step). The CPU primitive (kernels/cpu/ssm_update.cpp) is one sequential scan for
both: per (b, h) and block of state rows, the rows stay in L1 while it walks the tokens, each row updated and
dotted with C in registers, (b, h, row block) items split across the cores; no state: zeros.

mlx-lm's mask and lengths as its ssm_attn reads them: a masked token has no decay and no input (the state
stays) and its y is D * x plus the decayed state its 256-token chunk started from (what segsum's -inf leaves;
the engine's masked tokens are right padding, whose y nothing reads); the state returned is the one after token
lengths - 1, the incoming one for a negative length. On Metal and CUDA one shared body (`SSM`), the same scan
for decode and prefill: a 32-lane simdgroup per state row walking the tokens, each lane holding Ds / 32 of its
floats in registers (mlx-lm's own Metal decode kernel's layout, which ignores the mask and lengths; this body
honours them, and keeps the row as its chunk began for masked tokens); Ds a multiple of 32, else the reference.
One simdgroup per row walks every token in order, so a long prompt's parallelism is B * H * Dh rows, not its
tokens: whether that beats mlx-lm's chunked quadratic form on a GPU is for the self-check to find (timed
against `ssm_attn`, and for decode on Metal against mlx-lm's Metal kernel). Compiled (Metal stand-in, nvcc)
and emulated only: never run on a GPU. Every call where the self-check does not choose a kernel (none for
the back-end, or it lost or mismatched) runs mlx-lm's own. The self-check decides decode and prefill apart
(`phase_of`).

The engine routes the model's own `ssm_update` here (engine/fused_ops.py).
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import (
    Case, Kernel, KernelOp, KernelSpec, at_least_8, build, gpu_backend, int32_params, kernel_backend, random_array,
)  # fmt: skip
from trillm.kernels.layout import ModelShapes

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# The primitive sums the dot product in another order and adds D * x before rounding y once (mlx-lm rounds
# the SSM part and D * x apart): y one or two ulps of its dtype apart; the state float32.
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (1e-4, 1e-4), mx.float16: (8e-3, 8e-3), mx.bfloat16: (6e-2, 6e-2),
}  # fmt: skip
TIME_STEP_LIMIT = (0.001, 100.0)  # mlx-lm's default


class SsmUpdateFn(Protocol):
    def __call__(self, x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
                 dt_bias: mx.array, state: mx.array | None, time_step_limit: tuple[float, float] = TIME_STEP_LIMIT,
                 mask: mx.array | None = None,
                 lengths: mx.array | None = None) -> tuple[mx.array, mx.array]: ...  # fmt: skip


def ssm_update_ref(x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
                   dt_bias: mx.array, state: mx.array | None, time_step_limit: tuple[float, float] = TIME_STEP_LIMIT,
                   mask: mx.array | None = None, lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """x [B, L, H, Dh]; B, C [B, L, G, Ds]; A_log, D, dt_bias [H]; dt [B, L, H] (raw); state [B, H, Dh, Ds] or
    None (zeros); mask [B, L] or None; lengths [B] or None -> (y [B, L, H, Dh] in x's dtype, new state):
    mlx-lm's ops (`ssm_attn`, SSD's chunked quadratic form)."""
    from mlx_lm.models.ssm import ssm_attn

    y, new = ssm_attn(x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask=mask, lengths=lengths)
    return y, new


def ssm_update_cpu(x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
                   dt_bias: mx.array, state: mx.array | None,
                   time_step_limit: tuple[float, float] = TIME_STEP_LIMIT, mask: mx.array | None = None,
                   lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """`ssm_update` as a primitive of trillm's CPU extension, dt and A computed as mlx-lm computes them."""
    from mlx_lm.models.ssm import compute_dt

    dtf = compute_dt(dt, dt_bias, time_step_limit)
    A = -mx.exp(A_log).astype(mx.float32)
    m = mask.reshape(mask.shape[0], -1) if mask is not None else None
    y, new = cpu_ext.require().ssm_update(x, A, B, C, D, dtf, state, m, lengths)
    return y, new


def _takes_call(x: mx.array, B: mx.array, C: mx.array, state: mx.array | None, mask: mx.array | None = None,
                lengths: mx.array | None = None) -> bool:
    """Whether the CPU primitive takes this call: any number of tokens, with or without a state."""
    b, length = (x.shape[0], x.shape[1]) if x.ndim == 4 else (0, 0)
    return (x.ndim == 4 and length >= 1 and B.ndim == 4 and x.dtype in _DTYPES and B.dtype == x.dtype
            and C.dtype == x.dtype and C.shape == B.shape and B.shape[:2] == (b, length) and B.shape[2] > 0
            and x.shape[2] % B.shape[2] == 0
            and (state is None or state.shape == (b, x.shape[2], x.shape[3], B.shape[3]))
            and (mask is None or mask.size == b * length) and (lengths is None or lengths.size == b))  # fmt: skip


def _gpu_takes_call(x: mx.array, B: mx.array, C: mx.array, state: mx.array | None, mask: mx.array | None = None,
                    lengths: mx.array | None = None) -> bool:
    """Whether the shared GPU body takes this call: what the CPU primitive takes, with Ds a multiple of 32."""
    return _takes_call(x, B, C, state, mask, lengths) and B.shape[3] % 32 == 0


def ssm_update_cpu_kernel(x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
                          dt_bias: mx.array, state: mx.array | None,
                          time_step_limit: tuple[float, float] = TIME_STEP_LIMIT, mask: mx.array | None = None,
                          lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The "cpu" kernel the self-check runs: the primitive for a call it takes, else the reference."""
    fn = ssm_update_cpu if _takes_call(x, B, C, state, mask, lengths) else ssm_update_ref
    return fn(x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths)


def ssm_update(x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
               dt_bias: mx.array, state: mx.array | None, time_step_limit: tuple[float, float] = TIME_STEP_LIMIT,
               mask: mx.array | None = None, lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The state-space update: the CPU primitive on CPU (decode and prefill), else the reference. Unchecked: the
    engine runs what its start-up self-check chose (`trillm.kernels.selfcheck`)."""
    fn = ssm_update_cpu_kernel if cpu_ext.enabled() else ssm_update_ref
    return fn(x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths)


# Template: InT (x, B, C, y), H, G, Dh, Ds, HAS_STATE, HAS_MASK, HAS_LENGTHS. Inputs A, D [H], dt [B * L * H]
# (softplus'd, clipped), mask int32 [B * L], lengths int32 [B] (each padded to 8 elements; a dummy where its
# HAS_ is false), state_in float32 [B, H, Dh, Ds] (a dummy without HAS_STATE), params int32 (L). Grid (32, Dh,
# B * H), threadgroups of 32: one simdgroup per state row (b, h, d) walking the L tokens, lane l holding the
# row's floats l * NPT .. + NPT (Ds a multiple of 32) and, with a mask, the row as its 256-token chunk began:
# a masked token's y is D * x plus that state's dot with C, decayed by the chunk's dt * A so far (the CPU
# primitive's and ssm_attn's rule); the state written is the one after token lengths - 1 (clamped), the
# incoming one for a negative length.
_SSM_BODY = """
  constexpr int NPT = Ds / 32;
  const int L = params[0];
  const int n = thread_position_in_grid.z;
  const int b = n / H;
  const int h = n % H;
  const int g = h / (H / G);
  const int lane = thread_position_in_threadgroup.x;
  const int d = thread_position_in_grid.y;
  const int row = (n * Dh + d) * Ds + lane * NPT;
  const int len = HAS_LENGTHS ? lengths[b] : L;
  const int last = len < 0 ? -1 : MINI(MAXI(len - 1, 0), L - 1);
  const float a = A[h];
  const float dv = D[h];
  float cur[NPT];
  float start[NPT];
  UNROLL for (int i = 0; i < NPT; ++i) cur[i] = HAS_STATE ? state_in[row + i] : 0.0f;
  float cum = 0.0f;
  for (int t = 0; t < L; ++t) {
    if (HAS_MASK && t % 256 == 0) {
      cum = 0.0f;
      UNROLL for (int i = 0; i < NPT; ++i) start[i] = cur[i];
    }
    const int tok = b * L + t;
    const int bc = (tok * G + g) * Ds + lane * NPT;
    const int xo = (tok * H + h) * Dh + d;
    const float xr = static_cast<float>(x[xo]);
    float acc = 0.0f;
    if (HAS_MASK && mask[tok] == 0) {  // uniform over the simdgroup: one (b, t) for all its lanes
      UNROLL for (int i = 0; i < NPT; ++i) acc += start[i] * static_cast<float>(Cm[bc + i]);
      acc = simd_sum(acc) * EXPF(cum);
    } else {
      const float dtv = dt[tok * H + h];
      cum += dtv * a;
      const float dA = EXPF(dtv * a);
      const float dtx = dtv * xr;
      UNROLL for (int i = 0; i < NPT; ++i) {
        cur[i] = dA * cur[i] + dtx * static_cast<float>(Bm[bc + i]);
        acc += cur[i] * static_cast<float>(Cm[bc + i]);
      }
      acc = simd_sum(acc);
    }
    if (lane == 0) y[xo] = static_cast<InT>(acc + dv * xr);
    if (t == last) {
      UNROLL for (int i = 0; i < NPT; ++i) state_out[row + i] = cur[i];
    }
  }
  if (last < 0) {
    UNROLL for (int i = 0; i < NPT; ++i) state_out[row + i] = HAS_STATE ? state_in[row + i] : 0.0f;
  }
"""
SSM = KernelSpec("ssm_update", ("x", "A", "Bm", "Cm", "D", "dt", "state_in", "mask", "lengths", "params"),
                 ("y", "state_out"), _SSM_BODY)


def ssm_update_kernel(backend: str, x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array,
                      dt: mx.array, dt_bias: mx.array, state: mx.array | None,
                      time_step_limit: tuple[float, float] = TIME_STEP_LIMIT, mask: mx.array | None = None,
                      lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Launch the shared body on `backend` (any name in backend.FACTORIES). Shapes as the reference (any number
    of tokens, with or without a state); Ds a multiple of 32 and H of G."""
    from mlx_lm.models.ssm import compute_dt

    b, length, h, dh = x.shape
    g, ds = B.shape[2], B.shape[3]
    if ds % 32 or h % g:
        raise ValueError(f"the GPU kernel needs Ds a multiple of 32 and H a multiple of G, got {ds}, {h}/{g}")
    f32, i32 = mx.float32, mx.int32
    # A, D, dt, mask and lengths padded: under 8 elements MLX's Metal wrapper would compile a `constant`
    # variant for them.
    dtf = at_least_8(compute_dt(dt, dt_bias, time_step_limit).astype(f32))
    A = at_least_8(-mx.exp(A_log.astype(f32)))
    dummy = int32_params(0)
    outs: list[mx.array] = build(backend, SSM)(
        inputs=[x, A, B, C, at_least_8(D.astype(f32)), dtf, state.astype(f32) if state is not None else dummy,
                at_least_8(mask.astype(i32)) if mask is not None else dummy,
                at_least_8(lengths.astype(i32)) if lengths is not None else dummy, int32_params(length)],
        template=[("InT", x.dtype), ("H", h), ("G", g), ("Dh", dh), ("Ds", ds), ("HAS_STATE", state is not None),
                  ("HAS_MASK", mask is not None), ("HAS_LENGTHS", lengths is not None)],
        grid=(32, dh, b * h), threadgroup=(32, 1, 1),
        output_shapes=[x.shape, (b, h, dh, ds)], output_dtypes=[x.dtype, f32],
    )  # fmt: skip
    return outs[0], outs[1]


def ssm_update_gpu(x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
                   dt_bias: mx.array, state: mx.array | None, time_step_limit: tuple[float, float] = TIME_STEP_LIMIT,
                   mask: mx.array | None = None, lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """`ssm_update` as this GPU's kernel (Metal or CUDA), or the reference for a call it does not take."""
    return ssm_update_on(gpu_backend(), x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths)


def ssm_update_on(backend: str, x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array,
                  dt: mx.array, dt_bias: mx.array, state: mx.array | None,
                  time_step_limit: tuple[float, float] = TIME_STEP_LIMIT, mask: mx.array | None = None,
                  lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The shared body on `backend` for a call it takes, else the reference."""
    if not _gpu_takes_call(x, B, C, state, mask, lengths):
        return ssm_update_ref(x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths)
    return ssm_update_kernel(backend, x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths)


def _gpu_supports(shapes: ModelShapes) -> str | None:
    if shapes.dtype not in _DTYPES:
        return f"dtype {shapes.dtype} is not float32/float16/bfloat16"
    if shapes.ssm and shapes.ssm[3] % 32:
        return f"state size {shapes.ssm[3]} is not a multiple of 32"
    if shapes.ssm and shapes.ssm[0] % shapes.ssm[1]:
        return f"{shapes.ssm[0]} heads are not a multiple of {shapes.ssm[1]} groups"
    return None


def _case(label: str, shapes: ModelShapes, b: int, seed: int, masked: bool = False, length: int = 1,
          lengths: list[int] | None = None, with_state: bool = True) -> Case:
    """A call of `length` tokens per row. Decode `masked`: masked rows and rows that keep their state, apart.
    `lengths`: right-padded rows as the engine builds them (mask True at each row's first `lengths` tokens;
    a negative length: a row whose prompt ended before this call, every token masked)."""
    h, g, dh, ds = shapes.ssm
    dtype = shapes.dtype
    x = random_array((b, length, h, dh), dtype, seed)
    # Over several tokens B and C at 1 / sqrt(Ds): y of order one. At unit scale y reaches hundreds within a
    # few hundred tokens, and the reference's own rounding (C B^T in the input dtype) is ulps of that.
    bc = 1.0 if length == 1 else ds**-0.5
    B = random_array((b, length, g, ds), dtype, seed + 1, scale=bc)
    C = random_array((b, length, g, ds), dtype, seed + 2, scale=bc)
    # A_log, D and dt_bias as the model holds them (its dtype); dt spread around softplus's knee.
    A_log = mx.log(mx.abs(random_array((h,), mx.float32, seed + 3, scale=4.0)) + 1.0).astype(dtype)
    D = random_array((h,), dtype, seed + 4)
    dt = random_array((b, length, h), dtype, seed + 5, scale=2.0)
    dt_bias = random_array((h,), dtype, seed + 6)
    state = random_array((b, h, dh, ds), mx.float32, seed + 7, scale=0.5) if with_state else None
    mask = lens = None
    if masked:
        mask = mx.array([[i % 3 != 1] for i in range(b)])
        # At one token a length is at most 1 (mlx-lm reads the decay at position length - 1).
        lens = mx.array([-1 if i % 4 == 2 else 1 for i in range(b)])
    if lengths is not None:
        mask = mx.arange(length)[None, :] < mx.array(lengths)[:, None]
        lens = mx.array(lengths)
    tags = [f"B={b}"] + ([f"L={length}"] if length > 1 else []) + (["masked"] if mask is not None else [])
    return Case(" ".join([label, *tags, *([] if with_state else ["no state"])]),
                (x, A_log, B, C, D, dt, dt_bias, state, TIME_STEP_LIMIT, mask, lens))


def _check_cases(shapes: ModelShapes) -> list[Case]:
    # Prefill: a short chunk carrying a state; ragged right-padded rows (one empty, one whose prompt ended in
    # an earlier chunk); no state, across mlx-lm's 256-token chunks with padding in the second (one row: the
    # reference's [L, L] decay matrices make it the costliest case of the start-up check).
    return [_case("decode", shapes, 1, 60), _case("decode", shapes, 9, 70), _case("decode", shapes, 6, 80, True),
            _case("prefill", shapes, 1, 90, length=3), _case("prefill", shapes, 4, 95, length=19, lengths=[19, 7, 0, -3]),
            _case("prefill", shapes, 1, 85, length=260, lengths=[258], with_state=False)]  # fmt: skip


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    return [_case("decode", shapes, 1, 100), _case("decode", shapes, shapes.max_batch, 110),
            _case("prefill", shapes, 1, 120, length=shapes.chunk)]


def _phase(x: mx.array, *_: object, **__: object) -> str:
    return "decode" if x.shape[1] == 1 else "prefill"


def _supports(shapes: ModelShapes) -> str | None:
    return cpu_ext.supports(shapes, _DTYPES)


KERNELS: dict[str, Kernel] = {"cpu": Kernel(ssm_update_cpu_kernel, _supports),
                               "metal": Kernel(ssm_update_gpu, _gpu_supports),
                               "cuda": Kernel(ssm_update_gpu, _gpu_supports)}


def mlx_lm_own(x: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
               dt_bias: mx.array, state: mx.array | None, time_step_limit: tuple[float, float] = TIME_STEP_LIMIT,
               mask: mx.array | None = None, lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """What mlx-lm's ssm_update runs for these inputs: its Metal kernel on Metal for a decode call (which
    ignores mask and lengths), else its ops (the reference). What a kernel is timed against."""
    if kernel_backend() == "metal" and x.shape[1] == 1 and state is not None:
        from mlx_lm.models import ssm as mlx_ssm

        if (own := getattr(mlx_ssm, "ssm_update_kernel", None)) is not None:
            y, new = own(x, A_log, B, C, D, dt, dt_bias, state, time_step_limit)
            return y, new
    return ssm_update_ref(x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths)


OP = KernelOp(
    name="ssm_update", reference=ssm_update_ref, kernels=KERNELS, check_cases=_check_cases,
    timing_cases=_timing_cases, tolerances=TOLERANCES, applies=lambda s: bool(s.ssm), phase_of=_phase,
    fallback=mlx_lm_own,
)  # fmt: skip
