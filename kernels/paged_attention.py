"""Attention over the paged KV pool: decode (L == 1) and one prefill chunk (L > 1) through block tables.

Pool layout and the meaning of block_tables / context_lens: `trillm.kernels.layout`.

One op, one file (as mlx-lm's gated_delta.py): the shared Metal/CUDA kernel source, the pure-mx reference
`paged_attention_ref`, the GPU entry point `paged_attention_gpu` (Metal or CUDA, through one launcher the MLA
kernels share), and the dispatcher `paged_attention`.

Back-end contract. `KERNELS` maps a back-end name ("metal", "cuda", "cpu"; see `trillm.kernels.backend`) to
a `Kernel`: a function with exactly `paged_attention_ref`'s signature and semantics, plus `supports(shapes)`
saying why it cannot run a model's shapes (or None). The dispatcher runs `KERNELS[kernel_backend()]` when it
exists and supports the call, else the reference. The CPU back-end plugs in the same way: the MLX C++
extension's wrapper `paged_attention_cpu(...)`, whose `supports` names the reason when the extension cannot
be built or loaded. Whatever the back-end, the engine's start-up self-check
(`trillm.kernels.selfcheck`) runs `OP.check_cases` against the reference (finite, within `TOLERANCES`), times
`OP.timing_cases`, and falls back to the reference per op.

The GPU kernels. A threadgroup (NW simdgroups of 32 lanes) owns R = QT * HPG rows: QT consecutive queries
of one sequence times HPG query heads that share one KV head, so each K/V token is read once for all of
them. Each lane holds D / 32 contiguous values of the head dim; simdgroups stride over the tokens of one
context partition with an online softmax (flash-decoding). Simdgroups are merged in threadgroup memory;
with one partition the kernel writes the output, otherwise it writes per-partition (max, sum, unnormalised
output) and a reduction kernel merges partitions and the sinks. Only decode splits the context (prefill
has query tiles for parallelism); how finely is a per-back-end `SplitPolicy`.

The pools' dtype. Every implementation takes the K/V pools in the queries' dtype, the int8 cache with its
per-token, per-head float32 scales (`k_scale=`, `v_scale=`: `trillm.kernels.layout`), or the int4 cache (two
values a byte, (scale, min) per group of 32 along head_dim: `k_scale=`, `v_scale=` again), dequantized as each
token is read: on Metal/CUDA by a pair of kernels per cache (`ATTN_FINAL_INT8` / `ATTN_PARTIAL_INT8`,
`ATTN_FINAL_INT4` / `ATTN_PARTIAL_INT4`: the same body, each lane's values decoded and scaled as they load;
compiled and emulated only, never run on a GPU). The CPU primitive and the reference also take a float cache
of another dtype, which the GPU kernels refuse (`gpu_supports`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from trillm.kernels.backend import (
    Case, Kernel, KernelOp, KernelSpec, at_least_8, build, float32_params, gpu_backend, int32_params, kernel_backend,
)  # fmt: skip
from trillm.kernels import cpu_ext
from trillm.kernels.kv_gather import kv_gather_ref
from trillm.kernels.kv_write import dequantize_int4, dequantize_int8, int4_groups
from trillm.kernels.layout import KV_DTYPES, ModelShapes, random_batch

NUM_SIMDGROUPS = 4  # NW: 128 threads per threadgroup
MAX_ROWS_X_D = 1024  # R * D bound: keeps per-lane registers and threadgroup memory (16 KB) in check
MAX_PARTIAL_BYTES = 64 << 20  # the partial outputs' bound per call (B x Hq x L x num_parts x D floats)
GPU_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

# Kernel against reference, (atol, rtol) per dtype: the kernels sum in another order (online softmax over
# partitions) and Metal compiles them with fast math.
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (1e-4, 1e-4), mx.float16: (5e-3, 5e-3), mx.bfloat16: (3e-2, 3e-2),
}  # fmt: skip

_MAIN_INPUTS = ("q", "k_pool", "v_pool", "block_tables", "context_lens", "sinks", "scale", "meta")

# Template constants: T, D, BS, HKV, HQ, HPG, QT, NW, WINDOW (0 = none), CHUNK (0 = none), HAS_SOFTCAP,
# HAS_SINKS.
# meta (int32): [max_blocks, num_parts, part_size, L]; scale (float32): [scale, softcap (0 = none)]. Every
# input has >= 8 elements (see backend.int32_params), so MLX builds one variant per template tuple.
# What the paged and the MLA kernels share: the threadgroup's place in the grid (from meta), the merge of its
# simdgroups' softmax states (m, l, acc per row; then @EPILOGUE@ writes row `row`), the partial epilogue.
GRID_INDICES = """  const int max_blocks = meta[0];
  const int num_parts = meta[1];
  const int part_size = meta[2];
  const int L = meta[3];
  const int gx = threadgroup_position_in_grid.x;
  const int part = gx % num_parts;
  const int qtile = gx / num_parts;
  const int h0 = threadgroup_position_in_grid.y * HPG;
  const int b = threadgroup_position_in_grid.z;
  const int lane = thread_index_in_simdgroup;
  const int warp = simdgroup_index_in_threadgroup;
  const int tid = thread_position_in_threadgroup.x;
"""
MERGE_SIMDGROUPS = """  // Merge the simdgroups' partial softmax states.
  SHARED float sm_m[NW * R];
  SHARED float sm_l[NW * R];
  SHARED float sm_o[NW * R * D];
  UNROLL for (int r = 0; r < R; ++r) {
    if (lane == 0) {
      sm_m[warp * R + r] = m[r];
      sm_l[warp * R + r] = l[r];
    }
    UNROLL for (int e = 0; e < DPL; ++e) {
      sm_o[(warp * R + r) * D + lane * DPL + e] = acc[r][e];
    }
  }
  BARRIER();
  for (int idx = tid; idx < R * D; idx += NW * 32) {
    const int r = idx / D;
    const int d = idx % D;
    const int i = qtile * QT + r / HPG;
    const int h = h0 + r % HPG;
    if (i < L) {
      float M = NEG_INF;
      UNROLL for (int w = 0; w < NW; ++w) {
        M = MAXF(M, sm_m[w * R + r]);
      }
      float S = 0.0f;
      float O = 0.0f;
      UNROLL for (int w = 0; w < NW; ++w) {
        const float c = EXPF(sm_m[w * R + r] - M);
        S += sm_l[w * R + r] * c;
        O += sm_o[(w * R + r) * D + d] * c;
      }
      const size_t row = (size_t)(b * HQ + h) * L + i;
@EPILOGUE@
    }
  }
"""
PARTIAL_EPILOGUE = """
      const size_t slot = row * num_parts + part;
      o_part[slot * D + d] = O;
      if (d == 0) {
        m_part[slot] = M;
        l_part[slot] = S;
      }
"""
_MAIN_BODY = """
  constexpr int DPL = D / 32;
  constexpr int R = QT * HPG;
  constexpr int REP = HQ / HKV;
  constexpr int KV_ROW = @KV_ROW@;  // pool elements per token
  constexpr int KV_BLOCK = BS * KV_ROW;
  constexpr int CHUNK_DIV = CHUNK > 0 ? CHUNK : 1;  // never % 0, even in the branch CHUNK == 0 skips
""" + GRID_INDICES + """  const int kvh = h0 / REP;
  const int ctx = context_lens[b];
  const float sc = scale[0];
  const float cap = scale[1];
  const float inv_cap = HAS_SOFTCAP ? 1.0f / cap : 0.0f;

  // Row r = qi * HPG + hh: query qtile * QT + qi (absolute position ctx - L + i), head h0 + hh.
  int pos[QT];
  int lo[QT];
  int tok_lo = 2147483647;
  int tok_hi = 0;
  UNROLL for (int qi = 0; qi < QT; ++qi) {
    const int i = qtile * QT + qi;
    pos[qi] = (i < L) ? ctx - L + i : -1;
    lo[qi] = (WINDOW > 0) ? MAXI(0, pos[qi] - WINDOW + 1) : 0;
    if (CHUNK > 0 && i < L) {  // chunked attention: the query's own aligned chunk only
      lo[qi] = MAXI(lo[qi], pos[qi] - pos[qi] % CHUNK_DIV);
    }
    if (i < L) {
      tok_lo = MINI(tok_lo, lo[qi]);
      tok_hi = MAXI(tok_hi, pos[qi] + 1);
    }
  }
  // Tokens past the table do not exist: a longer context_len must not read the next row's table.
  tok_hi = MINI(tok_hi, max_blocks * BS);
  float qv[R][DPL];
  float m[R];
  float l[R];
  float acc[R][DPL];
  UNROLL for (int r = 0; r < R; ++r) {
    const int i = qtile * QT + r / HPG;
    const size_t qrow = ((size_t)(b * HQ + h0 + r % HPG) * L + MINI(i, L - 1)) * D + lane * DPL;
    UNROLL for (int e = 0; e < DPL; ++e) {
      qv[r][e] = static_cast<float>(q[qrow + e]) * sc;
      acc[r][e] = 0.0f;
    }
    m[r] = NEG_INF;
    l[r] = 0.0f;
  }

  const int start = MAXI(part * part_size, tok_lo);
  const int end = MINI((part + 1) * part_size, tok_hi);
  // 64-bit arithmetic once per block (Apple GPUs emulate 64-bit multiplies); offsets within a block are int.
  const int lane_off = kvh * D + lane * DPL;
  int cur = -1;
  auto kb = k_pool;
  auto vb = v_pool;
@SCALE_INIT@  for (int t = start + warp; t < end; t += NW) {
    const int j = t / BS;
    if (j != cur) {
      cur = j;
      const size_t blk = (size_t)block_tables[b * max_blocks + j];
      kb = k_pool + blk * KV_BLOCK;
      vb = v_pool + blk * KV_BLOCK;
@SCALE_BLOCK@    }
    float kf[DPL];
    float vf[DPL];
@LOAD_ROW@    UNROLL for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      UNROLL for (int e = 0; e < DPL; ++e) {
        s += qv[r][e] * kf[e];
      }
      s = simd_sum(s);
      if (HAS_SOFTCAP) {
        s = SOFTCAP(s, cap, inv_cap);
      }
      const bool ok = t >= lo[r / HPG] && t <= pos[r / HPG];
      const float mn = ok ? MAXF(m[r], s) : m[r];
      const float alpha = EXPF(m[r] - mn);
      const float p = ok ? EXPF(s - mn) : 0.0f;
      l[r] = l[r] * alpha + p;
      m[r] = mn;
      UNROLL for (int e = 0; e < DPL; ++e) {
        acc[r][e] = acc[r][e] * alpha + p * vf[e];
      }
    }
  }

""" + MERGE_SIMDGROUPS

_FINAL_EPILOGUE = """
      float Mf = M;
      if (HAS_SINKS) {
        Mf = MAXF(M, sinks[h]);
      }
      const float c = EXPF(M - Mf);
      float denom = S * c;
      if (HAS_SINKS) {
        denom += EXPF(sinks[h] - Mf);
      }
      // A row that sees no token and has no sink: 0 (as the CPU primitive), not 0 / 0.
      out[row * D + d] = static_cast<T>(denom > 0.0f ? O * c / denom : 0.0f);
"""

# One threadgroup of D threads per (b, h, i) row; merges the partitions' (max, sum, output) and the sink.
_REDUCE_BODY = """
  const int num_parts = meta[1];
  const int L = meta[3];
  const size_t row = threadgroup_position_in_grid.x;
  const int d = thread_position_in_threadgroup.x;
  const int h = (int)((row / L) % HQ);
  float M = NEG_INF;
  for (int p = 0; p < num_parts; ++p) {
    M = MAXF(M, m_part[row * num_parts + p]);
  }
  if (HAS_SINKS) {
    M = MAXF(M, sinks[h]);
  }
  float S = 0.0f;
  float O = 0.0f;
  for (int p = 0; p < num_parts; ++p) {
    const size_t slot = row * num_parts + p;
    const float c = EXPF(m_part[slot] - M);
    S += l_part[slot] * c;
    O += o_part[slot * D + d] * c;
  }
  if (HAS_SINKS) {
    S += EXPF(sinks[h] - M);
  }
  out[row * D + d] = static_cast<T>(S > 0.0f ? O / S : 0.0f);
"""

# How a token's K/V values reach the tile, so the tile loops only ever see float rows. A pool in the queries'
# dtype: as they are. The int8 cache: each value times its token and KV head's scale, read from the scale pools'
# slot beside the row (one float per lane and token, where the row's D / 32 values per lane are int8). The int4
# cache: each lane's values are nibbles of the token's D / 2 bytes (value 2i in byte i's low nibble, 2i + 1 in
# its high one), each times its group of 32's scale plus the group's minimum (the pair beside the row; with
# D % 32 == 0 a lane's D / 32 values may still straddle two groups, so the group is per value).
_ROW_LOAD = """    const int off = (t - j * BS) * KV_ROW + lane_off;
@SCALE_ROW@    UNROLL for (int e = 0; e < DPL; ++e) {
      kf[e] = static_cast<float>(kb[off + e])@K_TIMES@;
      vf[e] = static_cast<float>(vb[off + e])@V_TIMES@;
    }
"""
_FLOAT_LOADS = {"@KV_ROW@": "HKV * D", "@SCALE_INIT@": "", "@SCALE_BLOCK@": "",
                "@LOAD_ROW@": _ROW_LOAD.replace("@SCALE_ROW@", "").replace("@K_TIMES@", "").replace("@V_TIMES@", "")}
_INT8_LOADS = {
    "@KV_ROW@": "HKV * D",
    "@SCALE_INIT@": "  constexpr int SC_BLOCK = BS * HKV;  // scale pools: [num_blocks, BS, HKV] floats\n"
                    "  auto ksb = k_scale;\n  auto vsb = v_scale;\n",
    "@SCALE_BLOCK@": "      ksb = k_scale + blk * SC_BLOCK;\n      vsb = v_scale + blk * SC_BLOCK;\n",
    "@LOAD_ROW@": _ROW_LOAD.replace(
        "@SCALE_ROW@", "    const float ks = ksb[(t - j * BS) * HKV + kvh];\n"
                       "    const float vs = vsb[(t - j * BS) * HKV + kvh];\n",
    ).replace("@K_TIMES@", " * ks").replace("@V_TIMES@", " * vs"),
}  # fmt: skip
_INT4_LOADS = {
    "@KV_ROW@": "HKV * D / 2",  # bytes, two values each
    "@SCALE_INIT@": "  constexpr int SC_ROW = HKV * (D / 32) * 2;  // (scale, min) pools: [.., BS, HKV, D / 32, 2]\n"
                    "  constexpr int SC_BLOCK = BS * SC_ROW;\n"
                    "  auto ksb = k_scale;\n  auto vsb = v_scale;\n",
    "@SCALE_BLOCK@": "      ksb = k_scale + blk * SC_BLOCK;\n      vsb = v_scale + blk * SC_BLOCK;\n",
    "@LOAD_ROW@": """    const int off = (t - j * BS) * KV_ROW;
    const int soff = (t - j * BS) * SC_ROW;
    UNROLL for (int e = 0; e < DPL; ++e) {
      const int v = lane_off + e;  // the value's place in the token's HKV * D; D % 32 == 0: v / 32 is its group
      const int sh = (v & 1) * 4;
      const int g = soff + (v / 32) * 2;
      kf[e] = static_cast<float>((kb[off + v / 2] >> sh) & 15) * ksb[g] + ksb[g + 1];
      vf[e] = static_cast<float>((vb[off + v / 2] >> sh) & 15) * vsb[g] + vsb[g + 1];
    }
""",
}  # fmt: skip
_LOADS = {"float": _FLOAT_LOADS, "int8": _INT8_LOADS, "int4": _INT4_LOADS}


def _main_body(epilogue: str, kind: str) -> str:
    body = _MAIN_BODY.replace("@EPILOGUE@", epilogue)
    for mark, text in _LOADS[kind].items():
        body = body.replace(mark, text)
    assert "@" not in body, body
    return body


_INT8_INPUTS = ("q", "k_pool", "v_pool", "k_scale", "v_scale", *_MAIN_INPUTS[3:])
_PARTIAL_OUTPUTS = ("o_part", "m_part", "l_part")
ATTN_FINAL = KernelSpec("paged_attn_final", _MAIN_INPUTS, ("out",), _main_body(_FINAL_EPILOGUE, "float"))
ATTN_PARTIAL = KernelSpec("paged_attn_partial", _MAIN_INPUTS, _PARTIAL_OUTPUTS, _main_body(PARTIAL_EPILOGUE, "float"))
# The quantized caches' pairs (the reduction is shared: it merges float partials whatever the pools held).
ATTN_FINAL_INT8 = KernelSpec("paged_attn_final_int8", _INT8_INPUTS, ("out",), _main_body(_FINAL_EPILOGUE, "int8"))
ATTN_PARTIAL_INT8 = KernelSpec("paged_attn_partial_int8", _INT8_INPUTS, _PARTIAL_OUTPUTS,
                               _main_body(PARTIAL_EPILOGUE, "int8"))  # fmt: skip
ATTN_FINAL_INT4 = KernelSpec("paged_attn_final_int4", _INT8_INPUTS, ("out",), _main_body(_FINAL_EPILOGUE, "int4"))
ATTN_PARTIAL_INT4 = KernelSpec("paged_attn_partial_int4", _INT8_INPUTS, _PARTIAL_OUTPUTS,
                               _main_body(PARTIAL_EPILOGUE, "int4"))  # fmt: skip
ATTN_REDUCE = KernelSpec("paged_attn_reduce", ("o_part", "m_part", "l_part", "sinks", "meta"), ("out",), _REDUCE_BODY)


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """How finely decode splits each row's context over threadgroups (flash-decoding) on one back-end."""

    target_threadgroups: int  # enough threadgroups to fill the GPU when the batch alone does not
    min_partition: int  # fewest context tokens per threadgroup (16 per simdgroup): below it, no split


# MLX's own decode attention (sdpa_vector_2pass) splits into 32-1024 blocks on every Apple GPU. Metal: 128
# threadgroups keep the 8-40 cores of M-series GPUs busy; CUDA: about two per SM of an H100/H200 (132 SMs).
SPLIT_POLICIES: dict[str, SplitPolicy] = {"metal": SplitPolicy(128, 64), "cuda": SplitPolicy(264, 64)}
DEFAULT_SPLIT = SplitPolicy(128, 64)


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Tile sizes and partitions of one call."""

    hpg: int  # query heads per threadgroup (dividing the GQA ratio)
    qt: int  # queries per threadgroup
    num_parts: int  # context partitions (decode only); > 1 adds the reduction kernel
    part_size: int  # context tokens per partition
    num_qtiles: int

    @property
    def threadgroups_per_row(self) -> int:
        return self.num_qtiles * self.num_parts


def heads_per_group(rep: int, head_dim: int) -> int:
    """Largest divisor of the GQA ratio that keeps HPG <= 8 and HPG * D within MAX_ROWS_X_D."""
    return max(h for h in range(1, min(rep, 8) + 1) if rep % h == 0 and h * head_dim <= MAX_ROWS_X_D)


def launch_plan(
    backend: str, batch: int, num_q_heads: int, num_kv_heads: int, num_queries: int, head_dim: int, max_tokens: int
) -> LaunchPlan:
    """HPG heads x QT queries per threadgroup, and (decode) the context partitions for `backend`.

    `max_tokens` is the block table's width in tokens. A multi-token call splits too while its query tiles
    leave the GPU idle (a last prompt chunk of a few tokens at 32k), as far as the partial outputs
    (B x Hq x L x num_parts x D floats) stay within MAX_PARTIAL_BYTES; a long chunk fills the GPU with its
    tiles and keeps one partition. Prefill's QT depends only on the model, so every prefill length runs one
    kernel variant (final or partial).
    """
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim % 32:
        raise ValueError(f"head_dim must be a multiple of 32 for the kernels, got {head_dim}")
    hpg = heads_per_group(num_q_heads // num_kv_heads, head_dim)
    qt = 1 if num_queries == 1 else max(1, min(8 // hpg, MAX_ROWS_X_D // (hpg * head_dim)))
    num_qtiles = -(-num_queries // qt)
    policy = SPLIT_POLICIES.get(backend, DEFAULT_SPLIT)
    wanted = -(-policy.target_threadgroups // (batch * (num_q_heads // hpg) * num_qtiles))
    by_bytes = MAX_PARTIAL_BYTES // max(1, batch * num_q_heads * num_queries * head_dim * 4)
    num_parts = max(1, min(wanted, max_tokens // policy.min_partition, by_bytes))
    return LaunchPlan(hpg, qt, num_parts, -(-max_tokens // num_parts), num_qtiles)


def gpu_supports(shapes: ModelShapes) -> str | None:
    """Why the Metal/CUDA kernels cannot run these shapes, or None."""
    if shapes.head_dim % 32 or shapes.head_dim > MAX_ROWS_X_D:
        return f"head_dim {shapes.head_dim} is not a multiple of 32 up to {MAX_ROWS_X_D}"
    if shapes.dtype not in GPU_DTYPES:
        return f"dtype {shapes.dtype} is not float32/float16/bfloat16"
    kv = shapes.kv_dtype
    if kv not in (None, "int8", "int4") and getattr(mx, kv) != shapes.dtype:  # int8 / int4: their own variants
        return f"a {kv} KV cache for {shapes.dtype} queries (no Metal/CUDA variant yet)"
    return None


def check_shapes(q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array, context_lens: mx.array) -> None:
    """ValueError naming the mismatch: the kernels index by these shapes and would read out of bounds.

    The engine calls the selected implementation directly, not through the dispatcher, so the GPU entry
    points check too."""
    if q.ndim != 4 or k_pool.ndim != 4:
        raise ValueError(f"q must be [B, Hq, L, D] and the pools [num_blocks, bs, Hkv, D], got {q.shape} and {k_pool.shape}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool {v_pool.shape} must have k_pool's shape {k_pool.shape}")
    pool_d = k_pool.shape[3] * (2 if k_pool.dtype == mx.uint8 else 1)  # int4: two values a byte
    if q.shape[3] != pool_d:
        raise ValueError(f"q's head dim {q.shape[3]} differs from the pool's {pool_d}")
    if q.shape[1] % k_pool.shape[2]:
        raise ValueError(f"q's {q.shape[1]} heads are not a multiple of the pool's {k_pool.shape[2]} KV heads")
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(f"block_tables must be [B, max_blocks] and context_lens [B] for B = {q.shape[0]}, "
                         f"got {block_tables.shape} and {context_lens.shape}")  # fmt: skip


def check_scales(k_pool: mx.array, v_pool: mx.array, k_scale: mx.array | None, v_scale: mx.array | None) -> None:
    """ValueError unless an int8 pool comes with both float32 scale pools [num_blocks, bs, Hkv], an int4 pool
    (uint8, two values a byte) with both float32 (scale, min) pools [num_blocks, bs, Hkv, G, 2], and a float
    pool with none."""
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool {k_pool.dtype} and v_pool {v_pool.dtype} must share a dtype")
    if k_pool.dtype in (mx.int8, mx.uint8):
        want = k_pool.shape[:3]
        if k_pool.dtype == mx.uint8:
            want = (*want, int4_groups(2 * k_pool.shape[3]), 2)
        kind = "int8" if k_pool.dtype == mx.int8 else "int4"
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None or sc.shape != want or sc.dtype != mx.float32:
                got = "none" if sc is None else f"{sc.shape} {sc.dtype}"
                raise ValueError(f"an {kind} KV pool needs {name} float32 {want}, got {got}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale go with an int8 pool or an int4 pool, not {k_pool.dtype}")


def paged_attention_kernel(
    backend: str,
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    k_scale: mx.array | None = None,
    v_scale: mx.array | None = None,
) -> mx.array:
    """Launch the paged attention kernels on `backend` (any name in backend.FACTORIES). Shapes as the reference."""
    check_shapes(q, k_pool, v_pool, block_tables, context_lens)
    b, hq, length, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    max_blocks = block_tables.shape[1]
    _check_variant(window, softcap, chunk)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    kind = {mx.int8: "int8", mx.uint8: "int4"}.get(k_pool.dtype, "float")
    if kind == "float" and k_pool.dtype != q.dtype:
        raise ValueError(f"q {q.dtype} and the pools {k_pool.dtype}/{v_pool.dtype} must share a dtype")
    plan = launch_plan(backend, b, hq, hkv, length, d, max_blocks * bs)
    sinks_in = at_least_8(sinks.astype(mx.float32)) if sinks is not None else None
    scales = [k_scale, v_scale] if k_scale is not None and v_scale is not None else []  # a quantized cache's
    inputs = [q, k_pool, v_pool, *scales, *int32_tables(block_tables, context_lens),
              sinks_in if sinks_in is not None else float32_params(), float32_params(scale, softcap or 0.0),
              int32_params(max_blocks, plan.num_parts, plan.part_size, length)]  # fmt: skip
    template = [
        ("T", q.dtype), ("D", d), ("BS", bs), ("HKV", hkv), ("HQ", hq), ("HPG", plan.hpg),
        ("QT", plan.qt), ("NW", NUM_SIMDGROUPS), ("WINDOW", window or 0), ("CHUNK", chunk or 0),
        ("HAS_SOFTCAP", softcap is not None), ("HAS_SINKS", sinks is not None),
    ]  # fmt: skip
    kernels = {"float": (ATTN_FINAL, ATTN_PARTIAL), "int8": (ATTN_FINAL_INT8, ATTN_PARTIAL_INT8),
               "int4": (ATTN_FINAL_INT4, ATTN_PARTIAL_INT4)}[kind]
    return launch_attention(backend, kernels, q, inputs, template, plan, sinks_in)


def int32_tables(block_tables: mx.array, context_lens: mx.array) -> tuple[mx.array, mx.array]:
    """The block tables and context lengths as the kernels read them: int32, at least 8 elements each."""
    tables = block_tables if block_tables.dtype == mx.int32 else block_tables.astype(mx.int32)
    lens = context_lens if context_lens.dtype == mx.int32 else context_lens.astype(mx.int32)
    return at_least_8(tables), at_least_8(lens)


def launch_attention(backend: str, kernels: tuple[KernelSpec, KernelSpec], q: mx.array, inputs: list[mx.array],
                     template: list[tuple[str, Any]], plan: LaunchPlan, sinks: mx.array | None) -> mx.array:
    """Run one call of an attention kernel pair (paged, MLA) as `plan` splits it: the final kernel, or the
    partial kernel per context partition and the reduction over them, which adds the sinks. q: [B, H, L, D],
    the output's shape and dtype; the meta parameters are the last input."""
    (b, hq, length, d), nt = q.shape, NUM_SIMDGROUPS * 32
    grid = (plan.threadgroups_per_row * nt, hq // plan.hpg, b)
    if plan.num_parts == 1:
        outs: list[mx.array] = build(backend, kernels[0])(
            inputs=inputs, template=template, grid=grid, threadgroup=(nt, 1, 1),
            output_shapes=[q.shape], output_dtypes=[q.dtype],
        )  # fmt: skip
        return outs[0]
    rows = b * hq * length
    o_part, m_part, l_part = build(backend, kernels[1])(
        # no HAS_SINKS: the reduction adds them
        inputs=inputs, template=[t for t in template if t[0] != "HAS_SINKS"], grid=grid, threadgroup=(nt, 1, 1),
        # (max, sum) flat and >= 8 elements, so the reduction's inputs never switch address space
        output_shapes=[(rows, plan.num_parts, d), (max(rows * plan.num_parts, 8),), (max(rows * plan.num_parts, 8),)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )  # fmt: skip
    reduced: list[mx.array] = build(backend, ATTN_REDUCE)(
        inputs=[o_part, m_part, l_part, sinks if sinks is not None else float32_params(), inputs[-1]],
        template=[("T", q.dtype), ("D", d), ("HQ", hq), ("HAS_SINKS", sinks is not None)],
        grid=(rows * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype],
    )  # fmt: skip
    return reduced[0]


# ---------------------------------------------------------------- reference
def _check_variant(window: int | None, softcap: float | None, chunk: int | None = None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")


def paged_attention_ref(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    k_scale: mx.array | None = None,
    v_scale: mx.array | None = None,
) -> mx.array:
    """Pure-mx paged attention: gather K/V through the tables, mask, then `mx.fast` SDPA (GQA native).

    Shapes: q [B, Hq, L, D]; k_pool, v_pool [num_blocks, bs, Hkv, D]; block_tables int32 [B, max_blocks];
    context_lens int32 [B]; sinks [Hq] or None -> [B, Hq, L, D] in q's dtype.
    Query i of row b sits at position context_lens[b] - L + i and sees positions <= its own
    (and > pos - window when window is set; and, chunked as Llama 4's, >= pos - pos % chunk: its own aligned
    chunk of `chunk` positions, when chunk is set; both set: both bounds) that the table holds.
    softcap (Gemma 2's logit soft-capping): scores = tanh(scores / softcap) * softcap after the scale, before
    the mask, the sinks and the softmax.
    The whole table width is gathered, so pass a table trimmed to the batch's longest row; reading
    max(context_lens) here would force a host sync every layer.
    k_scale, v_scale: the int8 cache's float32 scales [num_blocks, bs, Hkv], or the int4 cache's (scale, min)
    [num_blocks, bs, Hkv, G, 2] with its uint8 pools [num_blocks, bs, Hkv, D / 2] (`trillm.kernels.layout`).
    """
    _check_variant(window, softcap, chunk)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    if k_pool.dtype != q.dtype:
        k_pool, v_pool, block_tables = _rows_in(q.dtype, k_pool, v_pool, k_scale, v_scale, block_tables)
    if q.shape[2] == 1:
        return _decode_ref(q, k_pool, v_pool, block_tables, context_lens, scale, window, sinks, softcap, chunk)
    n = block_tables.shape[1] * k_pool.shape[1]
    keys = kv_gather_ref(k_pool, block_tables, n)  # [B, Hkv, N, D]
    values = kv_gather_ref(v_pool, block_tables, n)
    mask = attention_mask(context_lens, q.shape[2], n, window, chunk)
    if softcap is not None:  # mx.fast SDPA has no soft-capping: the scores written out
        return _prefill_softcap_ref(q, keys, values, mask, scale, sinks, softcap)
    if sinks is not None and sinks.dtype != q.dtype:
        sinks = sinks.astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)


def _rows_in(dtype: mx.Dtype, k_pool: mx.array, v_pool: mx.array, k_scale: mx.array | None,
             v_scale: mx.array | None, block_tables: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The tables' blocks only, dequantized (int8) or cast to `dtype`, as a compact pool [B * n, bs, Hkv, D]
    with its own tables: the reference then reads them as any pool of the queries' dtype."""
    b, n = block_tables.shape
    kb, vb = k_pool[block_tables], v_pool[block_tables]  # [B, n, bs, Hkv, D]
    if k_scale is not None and v_scale is not None and k_pool.dtype == mx.uint8:  # int4: two values a byte
        kb = dequantize_int4(kb, k_scale[block_tables], dtype)
        vb = dequantize_int4(vb, v_scale[block_tables], dtype)
    elif k_scale is not None and v_scale is not None:
        kb = dequantize_int8(kb, k_scale[block_tables], dtype)
        vb = dequantize_int8(vb, v_scale[block_tables], dtype)
    else:
        kb, vb = kb.astype(dtype), vb.astype(dtype)
    shape = (b * n, *kb.shape[2:])
    return kb.reshape(shape), vb.reshape(shape), mx.arange(b * n, dtype=mx.int32).reshape(b, n)


def _softmax_with_sinks(scores: mx.array, sinks: mx.array | None) -> mx.array:
    """Softmax over the last axis of float32 scores [B, Hq, ..., N]; a sink is one more logit per head."""
    if sinks is None:
        return mx.softmax(scores, axis=-1)
    hq = scores.shape[1]
    sink_col = mx.broadcast_to(sinks.astype(mx.float32).reshape((1, hq) + (1,) * (scores.ndim - 2)),
                               scores.shape[:-1] + (1,))  # fmt: skip
    return mx.softmax(mx.concatenate([sink_col, scores], axis=-1), axis=-1)[..., 1:]


def _prefill_softcap_ref(
    q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float, sinks: mx.array | None,
    softcap: float,
) -> mx.array:  # fmt: skip
    """Soft-capped attention of q [B, Hq, L, D] over gathered K/V [B, Hkv, N, D], in float32."""
    b, hq, length, d = q.shape
    hkv = keys.shape[1]
    rep = hq // hkv
    qg = (q.astype(mx.float32) * scale).reshape(b, hkv, rep * length, d)
    scores = (qg @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(b, hq, length, -1)  # [B, Hq, L, N]
    scores = mx.tanh(scores / softcap) * softcap
    scores = mx.where(mask, scores, mx.array(-mx.inf, mx.float32))
    probs = _softmax_with_sinks(scores, sinks).reshape(b, hkv, rep * length, -1)
    return (probs @ values.astype(mx.float32)).reshape(b, hq, length, d).astype(q.dtype)


def _decode_ref(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array, context_lens: mx.array,
    scale: float, window: int | None, sinks: mx.array | None, softcap: float | None = None,
    chunk: int | None = None,
) -> mx.array:  # fmt: skip
    """Decode without the head-major transpose: block-diagonal queries against [B, N, Hkv * D] K/V.

    On CPU the [B, N, Hkv, D] -> [B, Hkv, N, D] copy costs more than the attention itself; multiplying
    queries that are zero outside their KV head's D-slice reads gathered K/V as they lie, for Hkv x the
    (negligible at L == 1) flops: 1.3-2x faster than the SDPA path from B = 8 up (`trillm bench kernels`).
    """
    b, hq, _, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    n = block_tables.shape[1] * bs
    rep = hq // hkv
    keys = k_pool[block_tables].reshape(b, n, hkv * d)  # whole blocks: [B, N, Hkv * D]
    values = v_pool[block_tables].reshape(b, n, hkv * d)
    slices = mx.eye(hkv, dtype=q.dtype).reshape(1, hkv, 1, hkv, 1)
    q_bd = ((q * scale).reshape(b, hkv, rep, 1, d) * slices).reshape(b, hq, hkv * d)
    scores = (q_bd @ keys.swapaxes(1, 2)).astype(mx.float32)  # [B, Hq, N]
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    mask = attention_mask(context_lens, 1, n, window, chunk).reshape(b, 1, n)
    scores = mx.where(mask, scores, mx.array(-mx.inf, mx.float32))
    probs = _softmax_with_sinks(scores, sinks)
    out = (probs.astype(values.dtype) @ values).reshape(b, hkv, rep, hkv, d)  # [B, group, rep, slice, D]
    out = mx.take_along_axis(out, mx.arange(hkv).reshape(1, hkv, 1, 1, 1), axis=3)
    return out.reshape(b, hq, 1, d).astype(q.dtype)


def attention_mask(context_lens: mx.array, num_queries: int, num_keys: int, window: int | None,
                   chunk: int | None = None) -> mx.array:  # fmt: skip
    """Boolean [B, 1, L, N]: True where query i of row b may attend to key position j.

    Query i sits at pos = context_lens[b] - L + i; allowed: j <= pos and (window is None or j > pos - window)
    and (chunk is None or j // chunk == pos // chunk, i.e. j >= pos - pos % chunk: Llama 4's chunked attention).
    """
    pos = context_lens.astype(mx.int32)[:, None, None, None] - num_queries + mx.arange(num_queries)[:, None]
    j = mx.arange(num_keys)
    allowed = j <= pos
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        allowed = allowed & (j > pos - window)
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        allowed = allowed & (j >= pos - pos % chunk)  # pos >= 0 wherever j <= pos, so % is floor-mod here
    return allowed


# ---------------------------------------------------------------- back-ends
def paged_attention_gpu(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    k_scale: mx.array | None = None,
    v_scale: mx.array | None = None,
) -> mx.array:
    """`paged_attention` as this GPU's kernels (Metal or CUDA). Shapes as the reference (int8 and int4 pools with
    their scales too)."""
    return paged_attention_kernel(
        gpu_backend(), q, k_pool, v_pool, block_tables, context_lens, scale=scale, window=window, sinks=sinks,
        softcap=softcap, chunk=chunk, k_scale=k_scale, v_scale=v_scale,
    )


def paged_attention_cpu(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    k_scale: mx.array | None = None,
    v_scale: mx.array | None = None,
) -> mx.array:
    """`paged_attention` as a primitive of trillm's CPU extension (kernels/cpu/paged_attention.cpp).

    The GPU kernels' work split (HPG heads x QT queries per item, PARTITION_SIZE partitions and a reduction),
    reading K/V through the tables with no gather copy. Shapes as the reference; raises RuntimeError when
    the extension is unavailable (see `trillm.kernels.cpu_ext`).
    """
    ext = cpu_ext.require()
    _check_variant(window, softcap, chunk)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    out: mx.array = ext.paged_attention(q, k_pool, v_pool, block_tables, context_lens, scale=scale,
                                        window=window or 0, sinks=sinks, softcap=softcap or 0.0, chunk=chunk or 0,
                                        k_scale=k_scale, v_scale=v_scale)
    return out


def cpu_supports(shapes: ModelShapes) -> str | None:
    """Why the CPU primitive cannot run these shapes (or None). Asking loads, or first builds, the extension."""
    if shapes.head_dim % 16:
        return f"head_dim {shapes.head_dim} is not a multiple of 16 (the primitive's vector width)"
    return cpu_ext.supports(shapes, GPU_DTYPES)


# Back-end -> implementation. The CPU one reports itself unsupported (with the reason) when its extension
# cannot be built or loaded, so every op then runs its reference.
KERNELS: dict[str, Kernel] = {
    "metal": Kernel(paged_attention_gpu, gpu_supports),
    "cuda": Kernel(paged_attention_gpu, gpu_supports),
    "cpu": Kernel(paged_attention_cpu, cpu_supports),
}


class PagedAttentionFn(Protocol):
    """The signature every implementation shares (`paged_attention_ref`'s)."""

    def __call__(
        self, q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array, context_lens: mx.array,
        *, scale: float, window: int | None = None, sinks: mx.array | None = None, softcap: float | None = None,
        chunk: int | None = None, k_scale: mx.array | None = None, v_scale: mx.array | None = None,
    ) -> mx.array: ...  # fmt: skip


# ---------------------------------------------------------------- dispatcher
def paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    k_scale: mx.array | None = None,
    v_scale: mx.array | None = None,
) -> mx.array:
    """Causal attention of q [B, Hq, L, D] over each row's cached K/V -> [B, Hq, L, D] in q's dtype.

    L == 1 is decode; L > 1 is one prefill chunk whose own K/V are already written to the pool
    (kv_write first), attending to its cached prefix through the table. Runs this back-end's kernel when
    it has one for these shapes, else the reference (TRILLM_KERNELS=ref forces it). Unchecked: the engine
    runs what its start-up self-check chose instead (`trillm.kernels.selfcheck`).
    """
    check_shapes(q, k_pool, v_pool, block_tables, context_lens)
    kernel = None
    kv_dtype = None if k_pool.dtype == q.dtype else str(k_pool.dtype).rsplit(".", 1)[-1]
    kv_dtype = "int4" if kv_dtype == "uint8" else kv_dtype
    if kv_dtype in KV_DTYPES:
        shapes = ModelShapes(q.shape[1], k_pool.shape[2], q.shape[3], k_pool.shape[1], q.dtype, window,
                             sinks is not None, softcap=softcap, attention_chunk=chunk, kv_dtype=kv_dtype)  # fmt: skip
        kernel = OP.kernel_for(kernel_backend(), shapes)
    impl: PagedAttentionFn = kernel.fn if kernel is not None else paged_attention_ref
    return impl(q, k_pool, v_pool, block_tables, context_lens, scale=scale, window=window, sinks=sinks,
                softcap=softcap, chunk=chunk, k_scale=k_scale, v_scale=v_scale)


# ---------------------------------------------------------------- self-check cases
CHECK_BATCHES = (1, 9)  # 9: more rows than MLX's 8-element `constant` address-space threshold
CHECK_QUERIES = (1, 3)  # plus the model's prefill chunk
CHECK_LONG_CONTEXT = 1029  # splits decode into partitions on every back-end's policy


def _case(shapes: ModelShapes, label: str, lens: list[int], num_queries: int, seed: int,
          window: int | None = None) -> Case:  # fmt: skip
    batch = random_batch(shapes, lens, num_queries, seed)
    sinks = None
    if shapes.sinks:
        sinks = mx.random.normal((shapes.num_q_heads,), key=mx.random.key(seed + 1)) * 2
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables, batch.context_lens)
    kwargs = {"scale": shapes.head_dim**-0.5, "window": window, "sinks": sinks, "softcap": shapes.softcap,
              "chunk": shapes.attention_chunk, **batch.scales}
    if window is not None:
        label += f" window {window}"
    if shapes.attention_chunk is not None:
        label += f" chunk {shapes.attention_chunk}"
    return Case(label, args, kwargs)


def _check_cases(shapes: ModelShapes) -> list[Case]:
    """Every variant serving launches: decode with one and with several partitions, prefill tiles, B in {1, 9}
    (a whole chunk at one batch only),
    for each window the model's layers use (the first in full; the others, each a kernel variant of its
    own, at B = 9 only), with the model's sinks, soft-capping and attention chunk. A chunked model's
    contexts also reach past one chunk (its first and a later chunk's queries, a prefill crossing a chunk
    boundary)."""
    cases: list[Case] = []
    top = shapes.max_context
    for k, window in enumerate(shapes.windows):
        for num_queries in sorted({*CHECK_QUERIES, min(shapes.chunk, top)}):
            batches = CHECK_BATCHES if k == 0 else CHECK_BATCHES[-1:]
            if num_queries == min(shapes.chunk, top) and num_queries not in CHECK_QUERIES:
                # A whole chunk at B = 9 launches no variant B = 1 and the short chunks do not (inputs are
                # padded past MLX's threshold; QT is the model's), and it is the costliest case.
                batches = batches[:1]
            for batch in batches:
                for long in (False, True):
                    ladder = [num_queries + j for j in (0, 1, shapes.block_size - 1, shapes.block_size,
                                                        2 * shapes.block_size + 3)]  # fmt: skip
                    lens = [min(ladder[i % len(ladder)], top) for i in range(batch)]
                    if long:
                        lens[-1] = min(max(CHECK_LONG_CONTEXT, num_queries), top)
                    label = f"B={batch} L={num_queries} contexts {min(lens)}..{max(lens)}"
                    cases.append(_case(shapes, label, lens, num_queries, seed=len(cases), window=window))
            c = shapes.attention_chunk
            if c is not None and c < top:
                # Contexts ending just before, at and after chunk boundaries (a prefill crossing one); the
                # whole prefill chunk at one row only, as above: its reference scores are L x the context.
                around = [c - 1, c, c + 1, c + (num_queries + 1) // 2, 2 * c + 3, 3 * c - 1]
                if num_queries == min(shapes.chunk, top) and num_queries not in CHECK_QUERIES:
                    around = around[3:4]
                lens = [min(max(n, num_queries), top) for n in around]
                label = f"B={len(lens)} L={num_queries} contexts {min(lens)}..{max(lens)} across chunks"
                cases.append(_case(shapes, label, lens, num_queries, seed=len(cases), window=window))
    return cases


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    """Decode at batch 1 and at the largest batch, and one prefill chunk after one chunk of prefix."""
    top = shapes.max_context
    big = shapes.max_batch
    chunk = min(shapes.chunk, top)
    window = None if None in shapes.windows else shapes.windows[0]  # full attention is the costlier
    return [
        _case(shapes, "decode B=1", [min(2048, top)], 1, seed=100, window=window),
        _case(shapes, f"decode B={big}", [min(512, top, max(1, 65536 // big))] * big, 1, seed=101, window=window),
        _case(shapes, f"prefill L={chunk}", [min(2 * chunk, top)], chunk, seed=102, window=window),
    ]


def _applies(shapes: ModelShapes) -> bool:
    # mlx-lm's MLA models attend through MLA only (or linear attention): no softmax layer of the pool's K/V.
    return not shapes.mla


def _phase(q: mx.array, *_: object, **__: object) -> str:
    """Decode (one query per row) or prefill: the self-check decides each on its own timing cases."""
    return "decode" if q.shape[2] == 1 else "prefill"


OP = KernelOp(
    name="paged_attention", reference=paged_attention_ref, kernels=KERNELS,
    check_cases=_check_cases, timing_cases=_timing_cases, tolerances=TOLERANCES, applies=_applies,
    phase_of=_phase,
)  # fmt: skip
