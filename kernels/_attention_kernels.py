"""Paged attention kernels (shared Metal/CUDA source) and their launch wrapper.

One algorithm serves decode and prefill. A threadgroup (NW simdgroups of 32 lanes) owns R = QT * HPG
rows: QT consecutive queries of one sequence times HPG query heads that share one KV head, so each K/V
token is read once for all of them. Lanes split the head dim (D / 32 values each); simdgroups stride over
the tokens of one context partition with an online softmax (flash-decoding). Simdgroups are merged in
threadgroup memory; with one partition the kernel writes the output, otherwise it writes per-partition
(max, sum, unnormalised output) and a reduction kernel merges partitions and the sinks.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels._build import KernelSpec, build
from trillm.kernels._dispatch import Backend

NUM_SIMDGROUPS = 4  # NW: 128 threads per threadgroup
PARTITION_SIZE = 512  # context tokens per threadgroup before the split-K reduction kicks in
MAX_ROWS_X_D = 1024  # R * D bound: keeps per-lane registers and threadgroup memory (16 KB) in check

_MAIN_INPUTS = ("q", "k_pool", "v_pool", "block_tables", "context_lens", "sinks", "scale", "meta")

# Template constants: T, D, BS, HKV, HQ, HPG, QT, NW, WINDOW (0 = none), HAS_SINKS.
# meta (int32): [max_blocks, num_parts, part_size, L].
_MAIN_BODY = """
  constexpr int DPL = D / 32;
  constexpr int R = QT * HPG;
  constexpr int REP = HQ / HKV;
  const int max_blocks = meta[0];
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
  const int kvh = h0 / REP;
  const int ctx = context_lens[b];
  const float sc = scale[0];

  // Row r = qi * HPG + hh: query qtile * QT + qi (absolute position ctx - L + i), head h0 + hh.
  int pos[QT];
  int lo[QT];
  int tok_lo = 2147483647;
  int tok_hi = 0;
  for (int qi = 0; qi < QT; ++qi) {
    const int i = qtile * QT + qi;
    pos[qi] = (i < L) ? ctx - L + i : -1;
    lo[qi] = (WINDOW > 0) ? MAXI(0, pos[qi] - WINDOW + 1) : 0;
    if (i < L) {
      tok_lo = MINI(tok_lo, lo[qi]);
      tok_hi = MAXI(tok_hi, pos[qi] + 1);
    }
  }
  float qv[R][DPL];
  float m[R];
  float l[R];
  float acc[R][DPL];
  for (int r = 0; r < R; ++r) {
    const int i = qtile * QT + r / HPG;
    const size_t qrow = ((size_t)(b * HQ + h0 + r % HPG) * L + MINI(i, L - 1)) * D;
    for (int e = 0; e < DPL; ++e) {
      qv[r][e] = static_cast<float>(q[qrow + lane + 32 * e]) * sc;
      acc[r][e] = 0.0f;
    }
    m[r] = NEG_INF;
    l[r] = 0.0f;
  }

  const int start = MAXI(part * part_size, tok_lo);
  const int end = MINI((part + 1) * part_size, tok_hi);
  for (int t = start + warp; t < end; t += NW) {
    const int blk = block_tables[b * max_blocks + t / BS];
    const size_t base = ((size_t)blk * BS + t % BS) * (HKV * D) + kvh * D + lane;
    float kf[DPL];
    float vf[DPL];
    for (int e = 0; e < DPL; ++e) {
      kf[e] = static_cast<float>(k_pool[base + 32 * e]);
      vf[e] = static_cast<float>(v_pool[base + 32 * e]);
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int e = 0; e < DPL; ++e) {
        s += qv[r][e] * kf[e];
      }
      s = simd_sum(s);
      const bool ok = t >= lo[r / HPG] && t <= pos[r / HPG];
      const float mn = ok ? MAXF(m[r], s) : m[r];
      const float alpha = EXPF(m[r] - mn);
      const float p = ok ? EXPF(s - mn) : 0.0f;
      l[r] = l[r] * alpha + p;
      m[r] = mn;
      for (int e = 0; e < DPL; ++e) {
        acc[r][e] = acc[r][e] * alpha + p * vf[e];
      }
    }
  }

  // Merge the simdgroups' partial softmax states.
  SHARED float sm_m[NW * R];
  SHARED float sm_l[NW * R];
  SHARED float sm_o[NW * R * D];
  for (int r = 0; r < R; ++r) {
    if (lane == 0) {
      sm_m[warp * R + r] = m[r];
      sm_l[warp * R + r] = l[r];
    }
    for (int e = 0; e < DPL; ++e) {
      sm_o[(warp * R + r) * D + lane + 32 * e] = acc[r][e];
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
      for (int w = 0; w < NW; ++w) {
        M = MAXF(M, sm_m[w * R + r]);
      }
      float S = 0.0f;
      float O = 0.0f;
      for (int w = 0; w < NW; ++w) {
        const float c = EXPF(sm_m[w * R + r] - M);
        S += sm_l[w * R + r] * c;
        O += sm_o[(w * R + r) * D + d] * c;
      }
      const size_t row = (size_t)(b * HQ + h) * L + i;
@EPILOGUE@
    }
  }
"""

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
      out[row * D + d] = static_cast<T>(O * c / denom);
"""

_PARTIAL_EPILOGUE = """
      const size_t slot = row * num_parts + part;
      o_part[slot * D + d] = O;
      if (d == 0) {
        m_part[slot] = M;
        l_part[slot] = S;
      }
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
  out[row * D + d] = static_cast<T>(O / S);
"""

ATTN_FINAL = KernelSpec("paged_attn_final", _MAIN_INPUTS, ("out",), _MAIN_BODY.replace("@EPILOGUE@", _FINAL_EPILOGUE))
ATTN_PARTIAL = KernelSpec(
    "paged_attn_partial", _MAIN_INPUTS, ("o_part", "m_part", "l_part"), _MAIN_BODY.replace("@EPILOGUE@", _PARTIAL_EPILOGUE)
)
ATTN_REDUCE = KernelSpec("paged_attn_reduce", ("o_part", "m_part", "l_part", "sinks", "meta"), ("out",), _REDUCE_BODY)
SPECS = (ATTN_FINAL, ATTN_PARTIAL, ATTN_REDUCE)


def kernel_supports(q: mx.array, k_pool: mx.array) -> bool:
    """Shapes and dtypes the kernels handle; anything else runs the reference."""
    d = q.shape[-1]
    return (
        d % 32 == 0 and d <= MAX_ROWS_X_D and q.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and k_pool.dtype == q.dtype and q.shape[1] % k_pool.shape[2] == 0
    )  # fmt: skip


def heads_per_group(rep: int, head_dim: int) -> int:
    """Largest divisor of the GQA ratio that keeps HPG <= 8 and HPG * D within MAX_ROWS_X_D."""
    return max(h for h in range(1, min(rep, 8) + 1) if rep % h == 0 and h * head_dim <= MAX_ROWS_X_D)


def launch_plan(
    batch: int, num_q_heads: int, num_kv_heads: int, num_queries: int, head_dim: int, max_tokens: int
) -> dict[str, int]:
    """Tile sizes and grid for one call: HPG heads x QT queries per threadgroup, and the partitions."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim % 32:
        raise ValueError(f"head_dim must be a multiple of 32 for the kernels, got {head_dim}")
    hpg = heads_per_group(num_q_heads // num_kv_heads, head_dim)
    qt = 1 if num_queries == 1 else max(1, min(8 // hpg, MAX_ROWS_X_D // (hpg * head_dim), num_queries))
    num_parts = max(1, -(-max_tokens // PARTITION_SIZE))
    return dict(hpg=hpg, qt=qt, num_parts=num_parts, num_qtiles=-(-num_queries // qt))


def paged_attention_kernel(
    backend: Backend,
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None,
    sinks: mx.array | None,
) -> mx.array:
    """Launch the paged attention kernels on `backend`. Shapes as `paged_attention_ref`."""
    b, hq, length, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    max_blocks = block_tables.shape[1]
    plan = launch_plan(b, hq, hkv, length, d, max_blocks * bs)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    nt = NUM_SIMDGROUPS * 32
    meta = mx.array([max_blocks, plan["num_parts"], PARTITION_SIZE, length], dtype=mx.int32)
    sinks_in = sinks.astype(mx.float32) if sinks is not None else mx.zeros((hq,), dtype=mx.float32)
    inputs = [
        q, k_pool, v_pool, block_tables.astype(mx.int32), context_lens.astype(mx.int32),
        sinks_in, mx.array([scale], dtype=mx.float32), meta,
    ]  # fmt: skip
    template = [
        ("T", q.dtype), ("D", d), ("BS", bs), ("HKV", hkv), ("HQ", hq), ("HPG", plan["hpg"]),
        ("QT", plan["qt"]), ("NW", NUM_SIMDGROUPS), ("WINDOW", window or 0), ("HAS_SINKS", sinks is not None),
    ]  # fmt: skip
    grid = (plan["num_qtiles"] * plan["num_parts"] * nt, hq // plan["hpg"], b)
    if plan["num_parts"] == 1:
        (out,) = build(backend, ATTN_FINAL)(
            inputs=inputs, template=template, grid=grid, threadgroup=(nt, 1, 1),
            output_shapes=[q.shape], output_dtypes=[q.dtype],
        )  # fmt: skip
        return out
    rows = b * hq * length
    o_part, m_part, l_part = build(backend, ATTN_PARTIAL)(
        inputs=inputs, template=template[:-1], grid=grid, threadgroup=(nt, 1, 1),  # no HAS_SINKS: the reduction adds them
        output_shapes=[(rows, plan["num_parts"], d), (rows, plan["num_parts"]), (rows, plan["num_parts"])],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )  # fmt: skip
    (out,) = build(backend, ATTN_REDUCE)(
        inputs=[o_part, m_part, l_part, sinks_in, meta],
        template=[("T", q.dtype), ("D", d), ("HQ", hq), ("HAS_SINKS", sinks is not None)],
        grid=(rows * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype],
    )  # fmt: skip
    return out
