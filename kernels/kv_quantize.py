"""The int8 KV cache's write on Metal/CUDA: one kernel quantizes a step's new K and V, MLX's scatter stores them.

`kv_write_int8_ref` (trillm.kernels.kv_write) quantizes with mx ops, about eight per tensor (cast, abs, max,
maximum, divide, multiply, round, cast, and the scale's multiply), each its own launch on a GPU, for K and V of
every layer at every step. `kv_quantize_int8_kernel` does both tensors in one launch: one simdgroup per token
and KV head, each lane D / 32 values, the absmax through simd_max, then each value times 127 / absmax rounded
half to even, and the scale absmax / 127: the reference's arithmetic operation for operation (DIV_RN keeps the
division correctly rounded under fast math), so the self-check requires equality. The pools are still written
by MLX's scatter, in place (`trillm.kernels.kv_write`: a kernel's output is always a new array, so a kernel
writing the pool would copy all of it per call).

Op "kv_write_int8": the reference `kv_write_int8_ref`, `kv_write_int8_gpu` (the kernel, then the scatter) and
the dispatcher `kv_write_int8`. The self-check runs it for int8-cache models; only Metal and CUDA have a kernel
(the CPU runs the reference). Compiled (Metal stand-in, nvcc) and emulated on CPU only, never run on a GPU.
"""

from __future__ import annotations

import random

import mlx.core as mx

from trillm.kernels.backend import Case, Kernel, KernelOp, KernelSpec, build, gpu_backend, int32_params, kernel_backend
from trillm.kernels.kv_write import kv_write_int8_ref, kv_write_ref
from trillm.kernels.layout import ModelShapes

NUM_SIMDGROUPS = 4  # rows (token x KV head) per threadgroup of 128 threads
GPU_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

# Template: T (the new K/V's dtype), D, NW. meta: [rows = T x Hkv]. grid.y: 0 quantizes keys, 1 values.
_QUANTIZE_BODY = """
  constexpr int DPL = (D + 31) / 32;
  const int rows = meta[0];
  const int lane = thread_index_in_simdgroup;
  const int row = threadgroup_position_in_grid.x * NW + simdgroup_index_in_threadgroup;
  const bool is_v = threadgroup_position_in_grid.y == 1;
  if (row < rows) {  // uniform per simdgroup: simd_max below sees all 32 lanes
    auto src = is_v ? values : keys;
    const size_t base = (size_t)row * D;
    float x[DPL];
    float amax = 0.0f;
    UNROLL for (int e = 0; e < DPL; ++e) {
      const int d = lane + 32 * e;
      x[e] = d < D ? static_cast<float>(src[base + d]) : 0.0f;
      amax = MAXF(amax, MAXF(x[e], -x[e]));
    }
    amax = simd_max(amax);
    // quantize_int8's order: x * (127 / max(absmax, 1e-30)), rounded half to even; scale absmax * (1 / 127)
    const float inv = DIV_RN(127.0f, MAXF(amax, 1.0e-30f));
    auto dst = is_v ? qv : qk;
    UNROLL for (int e = 0; e < DPL; ++e) {
      const int d = lane + 32 * e;
      if (d < D) {
        dst[base + d] = static_cast<int8_t>(RINTF(x[e] * inv));
      }
    }
    if (lane == 0) {
      auto sc = is_v ? sv : sk;
      sc[row] = amax * (1.0f / 127.0f);
    }
  }
"""

QUANTIZE_INT8 = KernelSpec("kv_quantize_int8", ("keys", "values", "meta"), ("qk", "qv", "sk", "sv"), _QUANTIZE_BODY)


def kv_quantize_int8_kernel(backend: str, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
    """`quantize_int8` of keys and of values in one launch on `backend`: keys, values [T, Hkv, D] ->
    (int8 keys [T, Hkv, D], their float32 scales [T, Hkv], int8 values, their scales)."""
    t, hkv, d = keys.shape
    rows = t * hkv
    if values.dtype != keys.dtype:
        values = values.astype(keys.dtype)
    qk, qv, sk, sv = build(backend, QUANTIZE_INT8)(
        inputs=[keys, values, int32_params(rows)],
        template=[("T", keys.dtype), ("D", d), ("NW", NUM_SIMDGROUPS)],
        grid=(-(-rows // NUM_SIMDGROUPS) * NUM_SIMDGROUPS * 32, 2, 1), threadgroup=(NUM_SIMDGROUPS * 32, 1, 1),
        output_shapes=[keys.shape, keys.shape, (t, hkv), (t, hkv)],
        output_dtypes=[mx.int8, mx.int8, mx.float32, mx.float32],
    )  # fmt: skip
    return qk, sk, qv, sv


def kv_write_int8_kernel(
    backend: str, k_pool: mx.array, v_pool: mx.array, k_scale: mx.array, v_scale: mx.array, keys: mx.array,
    values: mx.array, slot_mapping: mx.array,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:  # fmt: skip
    """`kv_write_int8_ref` with its quantization as one launch on `backend` (any name in backend.FACTORIES)."""
    if keys.shape[0] == 0:  # nothing to write (and no empty grid to launch)
        return k_pool, v_pool, k_scale, v_scale
    qk, sk, qv, sv = kv_quantize_int8_kernel(backend, keys, values)
    k_pool, v_pool = kv_write_ref(k_pool, v_pool, qk, qv, slot_mapping)
    k_scale, v_scale = kv_write_ref(k_scale, v_scale, sk, sv, slot_mapping)  # the scale pools' slots alike
    return k_pool, v_pool, k_scale, v_scale


def kv_write_int8_gpu(
    k_pool: mx.array, v_pool: mx.array, k_scale: mx.array, v_scale: mx.array, keys: mx.array, values: mx.array,
    slot_mapping: mx.array,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:  # fmt: skip
    """`kv_write_int8` through this GPU's kernel (Metal or CUDA). Shapes as `kv_write_int8_ref`."""
    return kv_write_int8_kernel(gpu_backend(), k_pool, v_pool, k_scale, v_scale, keys, values, slot_mapping)


def gpu_supports(shapes: ModelShapes) -> str | None:
    return None if shapes.dtype in GPU_DTYPES else f"dtype {shapes.dtype} is not float32/float16/bfloat16"


KERNELS: dict[str, Kernel] = {"metal": Kernel(kv_write_int8_gpu, gpu_supports), "cuda": Kernel(kv_write_int8_gpu, gpu_supports)}


def kv_write_int8(
    k_pool: mx.array, v_pool: mx.array, k_scale: mx.array, v_scale: mx.array, keys: mx.array, values: mx.array,
    slot_mapping: mx.array,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:  # fmt: skip
    """Quantize new K/V per token and head and write them and their scales; returns the four updated pools.

    Shapes as `kv_write_int8_ref`. This back-end's kernel when it has one, else the reference; unchecked (the
    engine runs what its start-up self-check chose).
    """
    _, bs, hkv, d = k_pool.shape
    kernel = OP.kernel_for(kernel_backend(), ModelShapes(hkv, hkv, d, bs, keys.dtype, kv_dtype="int8"))
    impl = kernel.fn if kernel is not None else kv_write_int8_ref
    out: tuple[mx.array, mx.array, mx.array, mx.array] = impl(k_pool, v_pool, k_scale, v_scale, keys, values,
                                                              slot_mapping)  # fmt: skip
    return out


# ---------------------------------------------------------------- self-check cases
def _case(shapes: ModelShapes, label: str, num_tokens: int, seed: int) -> Case:
    """num_tokens new K/V rows, heads 1e-3 to 1e2 apart in magnitude, the middle token all zeros (scale 0) and
    the last one's first K head (last V head) on rounding ties, into random int8 pools (slots no write touches
    must come back unchanged) at distinct shuffled slots."""
    hkv, d, bs = shapes.num_kv_heads, shapes.head_dim, shapes.block_size
    num_blocks = -(-num_tokens // bs) + 2
    keys_k, values_k, pools_k, scales_k = mx.random.split(mx.random.key(seed), 4)
    magnitude = mx.power(10.0, mx.linspace(-3.0, 2.0, hkv)).reshape(1, hkv, 1)
    zero = (mx.arange(num_tokens) != num_tokens // 2).reshape(-1, 1, 1) if num_tokens > 1 else mx.array(1.0)
    keys = (mx.random.normal((num_tokens, hkv, d), key=keys_k) * magnitude * zero).astype(shapes.dtype)
    values = (mx.random.normal((num_tokens, hkv, d), key=values_k) * magnitude[:, ::-1] * zero).astype(shapes.dtype)
    if num_tokens > 1:  # absmax 127 / 8: each value times exactly 8, -7.5 .. 7.5 all halves (half to even)
        i = mx.arange(d)
        ties = (mx.where(i == 0, 127.0, (i % 16 - 8).astype(mx.float32) + 0.5) * 0.125).astype(shapes.dtype)
        keys[-1, 0] = ties
        values[-1, -1] = -ties
    pools = mx.random.randint(-127, 128, (2, num_blocks, bs, hkv, d), key=pools_k).astype(mx.int8)
    scales = mx.random.uniform(shape=(2, num_blocks, bs, hkv), key=scales_k)
    slots = mx.array(random.Random(seed).sample(range(num_blocks * bs), num_tokens), dtype=mx.int32)
    return Case(label, (pools[0], pools[1], scales[0], scales[1], keys, values, slots))


def _check_cases(shapes: ModelShapes) -> list[Case]:
    """Decode at B = 1 and 9, a short and a whole prefill chunk (one variant per dtype: T is no template)."""
    chunk = min(shapes.chunk, shapes.max_context, 130)
    return [_case(shapes, f"T={n}", n, seed=200 + n) for n in sorted({1, 9, 3, chunk})]


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    # Pools of a few blocks: the scatter costs kernel and reference alike, the quantization is what differs.
    chunk = min(shapes.chunk, shapes.max_context)
    return [_case(shapes, "decode B=1", 1, 300), _case(shapes, f"decode B={shapes.max_batch}", shapes.max_batch, 301),
            _case(shapes, f"prefill L={chunk}", chunk, 302)]  # fmt: skip


def _applies(shapes: ModelShapes) -> bool:
    return shapes.int8_kv and not shapes.mla  # MLA's latent caches are never int8 (the engine refuses them)


OP = KernelOp(
    name="kv_write_int8", reference=kv_write_int8_ref, kernels=KERNELS,
    check_cases=_check_cases, timing_cases=_timing_cases, exact=True, applies=_applies,
)  # fmt: skip
