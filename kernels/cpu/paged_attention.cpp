// Paged attention as an MLX CPU primitive: decode and prefill chunks read K/V straight from the block pool.
//
// The work split is the GPU kernels' (trillm.kernels._attention_kernels): one work item owns R = QT * HPG
// rows (QT consecutive queries of one sequence x the HPG query heads sharing one KV head), so every K/V
// token is read once for all of them, over one context partition of PARTITION_SIZE tokens, with an online
// softmax. With one partition the item writes the output; otherwise it writes (max, sum, unnormalised
// output) per partition and a reduction merges the partitions and the sinks. Where a GPU threadgroup
// strides simdgroups over tokens, a CPU item walks them in tiles of 16: 16 dot products reduced into one
// vector, one vectorised exp, then 16 FMAs of V rows into each row's accumulator.
//
// Decode differs in one way: an item takes the query heads of several KV heads (all of them, unless the
// batch is too small to keep the cores busy). A token's K (and V) for every KV head is one contiguous row
// of HKV * D values, so reading all heads of a token reads whole cache lines once, where one head's slice
// (D of every HKV * D values) leaves the prefetchers fetching lines another item reads again later.
//
// The pools may hold another dtype than the queries: a float16/bfloat16 cache for float32 queries, the int8
// cache (trillm.kernels.layout), whose float32 scale per token and KV head sits in a pool of its own, or the
// int4 cache (two values a byte, a float32 (scale, min) per group of head_dim, in pools of their own). Every
// way a tile's token rows are converted to float32 as they are read (token_row), so the tile loops below
// only ever see float rows; the int8 cache reads a quarter of float32's bytes per token, int4 an eighth
// (plus 8 bytes of (scale, min) per group of 32 values).
#include <algorithm>
#include <climits>
#include <cmath>
#include <memory>
#include <tuple>
#include <stdexcept>
#include <type_traits>
#include <vector>

#ifndef TRILLM_KERNEL_BODIES_ONLY  // tests/kernels/cpu_bodies.cpp compiles the kernel bodies alone, without mlx
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#endif
#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

namespace trillm_cpu {

namespace {

constexpr int MAX_ROWS = 32;  // R bound for prefill items: accumulators stay in L1 (32 x D floats)
constexpr int MAX_ROWS_X_D = 1024;  // the GPU kernels' HPG * D bound, kept so both pick the same HPG

struct AttnArgs {
  int B, HQ, L, D, BS, HKV, MB;  // MB: block table width
  int hpi, qt, num_qtiles, num_parts;  // hpi: query heads per item (HPG, or whole KV heads' worth in decode)
  int part_size;  // context tokens per partition (attention_partitions)
  float scale;
  int window;  // 0: none
  int chunk;  // chunked attention's chunk (Llama 4); 0: none
  float softcap;  // 0: none
  const int32_t* tables;
  const int32_t* lens;
  const float* sinks;  // nullptr: none
  const float* kscale;  // int8: scales [num_blocks, BS, HKV]; int4: (scale, min) [.., HKV, groups, 2]
  const float* vscale;  // (nullptr: a float cache)
  int groups;  // the int4 cache's groups per head (D / groups values each)
};

// n values of one token from `off` (its heads from the item's first), as float32: in place for a float32
// pool, else converted into scratch; an int8 pool's head h scaled by scales[sc_off + h] (D values per head);
// an int4 pool's (uint8, off still counting values) group g of head h as q * scale + min, from the pair at
// scales[((sc_off + h) * G + g) * 2].
template <typename T>
inline const float* token_row(const T* pool, size_t off, float* scratch, int n, const float* scales, size_t sc_off,
                              int D, int G) {
  if constexpr (std::is_same_v<T, float>) {
    return pool + off;
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    const int gs = D / G;
    for (int h = 0; h * D < n; ++h) {
      const uint8_t* src = pool + (off + static_cast<size_t>(h) * D) / 2;
      const float* sm = scales + (sc_off + h) * G * 2;
      float* dst = scratch + h * D;
      if (gs % (2 * W) == 0) {  // whole vector pairs per group (32 values: every ISA)
        for (int g = 0; g < G; ++g) {
          const vf s = vsplat(sm[2 * g]);
          const vf mn = vsplat(sm[2 * g + 1]);
          for (int d = g * gs; d < (g + 1) * gs; d += 2 * W) {
            vf lo, hi;
            vnibbles(src + d / 2, lo, hi);
            vstore(dst + d, lo * s + mn);
            vstore(dst + d + W, hi * s + mn);
          }
        }
      } else {
        for (int d = 0; d < D; ++d) {
          const int g = d / gs;
          dst[d] = static_cast<float>((src[d / 2] >> (4 * (d % 2))) & 15) * sm[2 * g] + sm[2 * g + 1];
        }
      }
    }
    return scratch;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    for (int h = 0; h * D < n; ++h) {
      const float sc = scales[sc_off + h];
      const int8_t* src = pool + off + static_cast<size_t>(h) * D;
      float* dst = scratch + h * D;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * sc;
    }
    return scratch;
  } else {
    for (int d = 0; d < n; ++d) scratch[d] = static_cast<float>(pool[off + d]);
    return scratch;
  }
}

const vi IOTA = viota();

// One tile of up to 16 tokens against some rows of an item: the rows' state and the tile's K/V rows.
struct RowTile {
  const float* qv;  // [R, D], scaled
  float* acc;       // [R, D]
  float* m;
  float* l;
  const int* pos;  // per query of the item
  const int* lo;
  int hpi, t0, n;
  vi tpos;
  const float* const* krow;
  const float* const* vrow;
  int ko;  // the rows' head, as an offset into a token's span
  float cap;  // soft-capping (0: none)
  float inv_cap;
};

// The online-softmax update of row r from its 16 scores s (invalid lanes masked here); p gets the weights.
inline float softmax_tile(const RowTile& t, int r, vf s, float* p_out) {
  const int qi = r / t.hpi;
  const vi valid = (t.tpos >= t.lo[qi]) & (t.tpos <= t.pos[qi]) & (t.tpos < t.t0 + t.n);
  if (t.cap > 0.0f) s = vsoftcap(s, t.cap, t.inv_cap);
  s = valid ? s : vsplat(NEG_INF);
  const float mo = t.m[r];
  const float mn = std::max(mo, vmaxf(s));
  const float alpha = std::exp(mo - mn);
  vf p = vexp(s - mn);
  p = valid ? p : vf{};
  t.l[r] = t.l[r] * alpha + vsum(p);
  t.m[r] = mn;
  vstore(p_out, p);
  return alpha;
}

inline bool sees_tile(const RowTile& t, int r) {
  const int qi = r / t.hpi;
  return t.pos[qi] >= t.t0 && t.lo[qi] < t.t0 + t.n;
}

// NB rows of one KV head, D = DC * 16: q in registers, each K vector loaded once for the NB dot products,
// each V vector once for the NB accumulators.
template <int NB, int DC>
inline void rows_tile(const RowTile& t, int r0) {
  bool any = false;
  for (int b = 0; b < NB; ++b) any |= sees_tile(t, r0 + b);
  if (!any) return;  // nothing these rows may see in the tile
  constexpr int D = DC * W;
  vf q[NB][DC];
  for (int b = 0; b < NB; ++b) {
    for (int c = 0; c < DC; ++c) q[b][c] = vload(t.qv + (r0 + b) * D + c * W);
  }
  vf dots[NB][W];
  for (int j = 0; j < W; ++j) {
    if (j < t.n) {
      vf kv[DC];
      for (int c = 0; c < DC; ++c) kv[c] = vload(t.krow[j] + t.ko + c * W);
      for (int b = 0; b < NB; ++b) {
        vf d = q[b][0] * kv[0];
        for (int c = 1; c < DC; ++c) d += q[b][c] * kv[c];
        dots[b][j] = d;
      }
    } else {
      for (int b = 0; b < NB; ++b) dots[b][j] = vf{};
    }
  }
  alignas(64) float p[NB][W];
  vf accv[NB][DC];
  for (int b = 0; b < NB; ++b) {
    const float alpha = softmax_tile(t, r0 + b, vsum_lanes(dots[b]), p[b]);
    for (int c = 0; c < DC; ++c) accv[b][c] = vload(t.acc + (r0 + b) * D + c * W) * alpha;
  }
  for (int j = 0; j < t.n; ++j) {
    vf vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = vload(t.vrow[j] + t.ko + c * W);
    for (int b = 0; b < NB; ++b) {
      const vf pj = vsplat(p[b][j]);
      for (int c = 0; c < DC; ++c) accv[b][c] += pj * vv[c];
    }
  }
  for (int b = 0; b < NB; ++b) {
    for (int c = 0; c < DC; ++c) vstore(t.acc + (r0 + b) * D + c * W, accv[b][c]);
  }
}

// One row, any D (a multiple of 16).
inline void row_tile_any(const RowTile& t, int r, int D) {
  if (!sees_tile(t, r)) return;
  const int DC = D / W;
  const float* qr = t.qv + r * D;
  vf dots[W];
  for (int j = 0; j < W; ++j) {
    vf s = vf{};
    if (j < t.n) {
      for (int c = 0; c < DC; ++c) s += vload(qr + c * W) * vload(t.krow[j] + t.ko + c * W);
    }
    dots[j] = s;
  }
  alignas(64) float p[W];
  const float alpha = softmax_tile(t, r, vsum_lanes(dots), p);
  float* ac = t.acc + r * D;
  for (int c = 0; c < DC; ++c) {
    vf av = vload(ac + c * W) * alpha;
    for (int j = 0; j < t.n; ++j) av += vsplat(p[j]) * vload(t.vrow[j] + t.ko + c * W);
    vstore(ac + c * W, av);
  }
}

// One work item. DCT: D / 16 when known at compile time (0: read from args). T: the queries' (and the
// output's) dtype; TKV: the pools'.
template <typename T, typename TKV, int DCT>
void attn_item(const AttnArgs& a, const T* q, const TKV* kp, const TKV* vp, int item, T* out, float* o_part,
               float* m_part, float* l_part) {
  const int DC = DCT ? DCT : a.D / W;
  const int D = DC * W;
  const int part = item % a.num_parts;
  int rest = item / a.num_parts;
  const int qtile = rest % a.num_qtiles;
  rest /= a.num_qtiles;
  const int groups = a.HQ / a.hpi;
  const int g = rest % groups;
  const int b = rest / groups;
  const int h0 = g * a.hpi;
  const int rep = a.HQ / a.HKV;
  const int kvh0 = h0 / rep;  // the item's first KV head
  const int span = std::max(1, a.hpi / rep) * D;  // K/V values per token the item reads (its KV heads)
  const int ctx = a.lens[b];
  const int R = a.qt * a.hpi;

  thread_local std::vector<float> buf;
  const size_t need = 2 * static_cast<size_t>(R) * D + 2 * R + 2 * static_cast<size_t>(W) * span;
  if (buf.size() < need) buf.resize(need);
  float* qv = buf.data();
  float* acc = qv + static_cast<size_t>(R) * D;
  float* m = acc + static_cast<size_t>(R) * D;
  float* l = m + R;
  float* kscr = l + R;
  float* vscr = kscr + static_cast<size_t>(W) * span;
  int kvoff[MAX_ROWS];  // row r's head, as an offset into the item's span of a token

  int pos[MAX_ROWS];
  int lo[MAX_ROWS];
  int tok_lo = INT_MAX;
  int tok_hi = 0;
  for (int qi = 0; qi < a.qt; ++qi) {
    const int i = qtile * a.qt + qi;
    pos[qi] = i < a.L ? ctx - a.L + i : -1;
    lo[qi] = a.window > 0 ? std::max(0, pos[qi] - a.window + 1) : 0;
    // Chunked: the query's own aligned chunk only. The item's token range (and so its partitions and the
    // blocks it reads) starts at the lowest such bound, so earlier chunks are never read.
    if (a.chunk > 0 && i < a.L) lo[qi] = std::max(lo[qi], pos[qi] - pos[qi] % a.chunk);
    if (i < a.L) {
      tok_lo = std::min(tok_lo, lo[qi]);
      tok_hi = std::max(tok_hi, pos[qi] + 1);
    }
  }
  // Tokens past the table do not exist: a longer context_len must not read the next row's table.
  tok_hi = std::min(tok_hi, a.MB * a.BS);
  for (int r = 0; r < R; ++r) {
    const int i = std::min(qtile * a.qt + r / a.hpi, a.L - 1);
    const int h = h0 + r % a.hpi;
    kvoff[r] = (h / rep - kvh0) * D;
    const size_t qrow = (static_cast<size_t>(b * a.HQ + h) * a.L + i) * D;
    for (int d = 0; d < D; ++d) {
      qv[r * D + d] = static_cast<float>(q[qrow + d]) * a.scale;
      acc[r * D + d] = 0.0f;
    }
    m[r] = NEG_INF;
    l[r] = 0.0f;
  }

  const int start = std::max(part * a.part_size, tok_lo);
  const int end = std::min((part + 1) * a.part_size, tok_hi);
  const size_t token_stride = static_cast<size_t>(a.HKV) * D;
  const int32_t* table = a.tables + static_cast<size_t>(b) * a.MB;
  const float* krow[W];
  const float* vrow[W];
  for (int t0 = start; t0 < end; t0 += W) {
    const int n = std::min(W, end - t0);
    for (int j = 0; j < n; ++j) {
      const int t = t0 + j;
      const size_t slot = static_cast<size_t>(table[t / a.BS]) * a.BS + t % a.BS;
      const size_t off = slot * token_stride + kvh0 * D;
      const size_t sc_off = slot * a.HKV + kvh0;
      krow[j] = token_row(kp, off, kscr + j * span, span, a.kscale, sc_off, D, a.groups);
      vrow[j] = token_row(vp, off, vscr + j * span, span, a.vscale, sc_off, D, a.groups);
    }
    // Blocks are scattered over the pool: hardware prefetchers lose the stream at every block, so ask for
    // the next tile while this one computes.
    constexpr int PER_ELT = std::is_same_v<TKV, uint8_t> ? 2 : 1;  // values a pool element holds (int4: 2)
    for (int t = t0 + W, te = std::min(t0 + 2 * W, end); t < te; ++t) {
      const size_t off =
          (static_cast<size_t>(table[t / a.BS]) * a.BS + t % a.BS) * token_stride / PER_ELT + kvh0 * D / PER_ELT;
      for (int e = 0; e < span / PER_ELT; e += 64 / static_cast<int>(sizeof(TKV))) {
        __builtin_prefetch(kp + off + e);
        __builtin_prefetch(vp + off + e);
      }
    }
    const vi tpos = IOTA + t0;
    for (int r0 = 0; r0 < R;) {
      // Rows of one KV head go together, up to 4: each K and V vector loaded once for all of them.
      int nb = 1;
      while (nb < 4 && r0 + nb < R && kvoff[r0 + nb] == kvoff[r0]) ++nb;
      const RowTile t{qv, acc, m, l, pos, lo, a.hpi, t0, n, tpos, krow, vrow, kvoff[r0], a.softcap,
                      a.softcap > 0.0f ? 1.0f / a.softcap : 0.0f};
      if constexpr (DCT > 0) {
        switch (nb) {
          case 4: rows_tile<4, DCT>(t, r0); break;
          case 3: rows_tile<3, DCT>(t, r0); break;
          case 2: rows_tile<2, DCT>(t, r0); break;
          default: rows_tile<1, DCT>(t, r0); break;
        }
      } else {
        for (int r = r0; r < r0 + nb; ++r) row_tile_any(t, r, D);
      }
      r0 += nb;
    }
  }

  for (int r = 0; r < R; ++r) {
    const int i = qtile * a.qt + r / a.hpi;
    if (i >= a.L) continue;
    const int h = h0 + r % a.hpi;
    const size_t row = static_cast<size_t>(b * a.HQ + h) * a.L + i;
    const float* ac = acc + r * D;
    if (a.num_parts == 1) {
      float mf = m[r];
      if (a.sinks) mf = std::max(mf, a.sinks[h]);
      const float c = std::exp(m[r] - mf);
      float denom = l[r] * c;
      if (a.sinks) denom += std::exp(a.sinks[h] - mf);
      const float f = denom > 0.0f ? c / denom : 0.0f;
      for (int d = 0; d < D; ++d) out[row * D + d] = static_cast<T>(ac[d] * f);
    } else {
      const size_t slot = row * a.num_parts + part;
      std::copy(ac, ac + D, o_part + slot * D);
      m_part[slot] = m[r];
      l_part[slot] = l[r];
    }
  }
}

template <typename T>
void reduce_row(const AttnArgs& a, size_t row, const float* o_part, const float* m_part, const float* l_part,
                T* out) {
  const int h = static_cast<int>((row / a.L) % a.HQ);
  const size_t base = row * a.num_parts;
  float M = NEG_INF;
  for (int p = 0; p < a.num_parts; ++p) M = std::max(M, m_part[base + p]);
  if (a.sinks) M = std::max(M, a.sinks[h]);
  float S = 0.0f;
  thread_local std::vector<float> o;
  o.assign(a.D, 0.0f);
  for (int p = 0; p < a.num_parts; ++p) {
    const float c = std::exp(m_part[base + p] - M);
    S += l_part[base + p] * c;
    const float* op = o_part + (base + p) * a.D;
    for (int d = 0; d < a.D; ++d) o[d] += op[d] * c;
  }
  if (a.sinks) S += std::exp(a.sinks[h] - M);
  const float f = S > 0.0f ? 1.0f / S : 0.0f;
  for (int d = 0; d < a.D; ++d) out[row * a.D + d] = static_cast<T>(o[d] * f);
}

template <typename T, typename TKV = T>
void run_attention(const AttnArgs& a, const T* q, const TKV* k, const TKV* v, T* out) {
  const int items = a.B * (a.HQ / a.hpi) * a.num_qtiles * a.num_parts;
  const size_t rows = static_cast<size_t>(a.B) * a.HQ * a.L;
  // Every (row, partition) slot is written by its item, so the outputs need no zero fill; their bytes are
  // bounded by attention_partitions.
  std::unique_ptr<float[]> o_part;
  std::vector<float> m_part, l_part;
  if (a.num_parts > 1) {
    o_part.reset(new float[rows * a.num_parts * a.D]);
    m_part.assign(rows * a.num_parts, NEG_INF);
    l_part.assign(rows * a.num_parts, 0.0f);
  }
  float *op = o_part.get(), *mp = m_part.data(), *lp = l_part.data();
  auto& pool = ThreadPool::get();
  pool.parallel_for(items, [&](int item) {
    if (a.D == 64) {
      attn_item<T, TKV, 64 / W>(a, q, k, v, item, out, op, mp, lp);
    } else if (a.D == 128) {
      attn_item<T, TKV, 128 / W>(a, q, k, v, item, out, op, mp, lp);
    } else {
      attn_item<T, TKV, 0>(a, q, k, v, item, out, op, mp, lp);
    }
  });
  if (a.num_parts > 1) {
    const int chunks = static_cast<int>(std::min<size_t>(rows, static_cast<size_t>(pool.size()) * 4));
    pool.parallel_for(chunks, [&](int c) {
      for (size_t row = c; row < rows; row += chunks) reduce_row(a, row, op, mp, lp, out);
    });
  }
}

}  // namespace

std::pair<int, int> attention_partitions(int batch, int num_q_heads, int num_queries, int head_dim, int max_tokens) {
  int parts = std::max(1, (max_tokens + PARTITION_SIZE - 1) / PARTITION_SIZE);
  // The partial outputs are rows x parts x D floats: a 512-token chunk of 32 heads x 128 at 32k would be
  // 512 MiB per layer call. Fewer, longer partitions keep them within MAX_PARTIAL_BYTES.
  const size_t per_part = std::max<size_t>(1, static_cast<size_t>(batch) * num_q_heads * num_queries * head_dim * sizeof(float));
  parts = static_cast<int>(std::min<size_t>(parts, std::max<size_t>(1, MAX_PARTIAL_BYTES / per_part)));
  return {parts, std::max(1, (max_tokens + parts - 1) / parts)};
}

int heads_per_group(int rep, int head_dim) {
  int best = 1;
  for (int h = 1; h <= std::min(rep, 8); ++h) {
    if (rep % h == 0 && h * head_dim <= MAX_ROWS_X_D) best = h;
  }
  return best;
}

int queries_per_tile(int num_queries, int hpg) {
  if (num_queries == 1) return 1;
  return std::max(1, std::min(MAX_ROWS / hpg, num_queries));
}

int decode_heads_per_item(int batch, int num_q_heads, int num_kv_heads, int head_dim, int num_parts, int threads) {
  const int rep = num_q_heads / num_kv_heads;
  // Whole KV heads per item, as many as keep >= 4 items per thread and the rows within MAX_ROWS.
  for (int nkv = num_kv_heads; nkv > 1; --nkv) {
    if (num_kv_heads % nkv || nkv * rep > MAX_ROWS) continue;
    if (static_cast<long>(batch) * (num_kv_heads / nkv) * num_parts >= 4L * threads) return nkv * rep;
  }
  return heads_per_group(rep, head_dim);
}

#ifndef TRILLM_KERNEL_BODIES_ONLY
mx::array paged_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                          const mx::array& block_tables, const mx::array& context_lens, float scale, int window,
                          const std::optional<mx::array>& sinks, float softcap, int chunk,
                          const std::optional<mx::array>& k_scale, const std::optional<mx::array>& v_scale,
                          mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k_pool.ndim() != 4 || v_pool.ndim() != 4) {
    throw std::invalid_argument("[trillm paged_attention] q and the pools must be 4-D");
  }
  if (k_pool.shape() != v_pool.shape()) {
    throw std::invalid_argument("[trillm paged_attention] k_pool and v_pool shapes differ");
  }
  if (q.dtype() != mx::float32 && q.dtype() != mx::float16 && q.dtype() != mx::bfloat16) {
    throw std::invalid_argument("[trillm paged_attention] dtype must be float32, float16 or bfloat16");
  }
  // The pools: q's dtype; float16/bfloat16 under float32 queries; int8 with float32 scales per token and head;
  // or int4 (uint8, two values a byte) with float32 (scale, min) per token, head and group.
  const auto kv = k_pool.dtype();
  const bool int8 = kv == mx::int8;
  const bool int4 = kv == mx::uint8;
  if (v_pool.dtype() != kv || !(kv == q.dtype() || int8 || int4 ||
                                (q.dtype() == mx::float32 && (kv == mx::float16 || kv == mx::bfloat16)))) {
    throw std::invalid_argument("[trillm paged_attention] the pools must share q's dtype, be float16/bfloat16 "
                                "under float32 queries, or be int8 or int4 (with scales)");
  }
  if ((int8 || int4) != bool(k_scale) || (int8 || int4) != bool(v_scale)) {
    throw std::invalid_argument("[trillm paged_attention] k_scale and v_scale go with an int8 or int4 pool, and "
                                "only with one");
  }
  const int B = q.shape(0), HQ = q.shape(1), D = q.shape(3), HKV = k_pool.shape(2);
  if (int8) {
    const mx::Shape want = {k_pool.shape(0), k_pool.shape(1), k_pool.shape(2)};
    for (const auto* sc : {&*k_scale, &*v_scale}) {
      if (sc->shape() != want || sc->dtype() != mx::float32) {
        throw std::invalid_argument("[trillm paged_attention] the int8 pools' scales must be float32 [num_blocks, bs, Hkv]");
      }
    }
  }
  if (int4) {
    const int G = k_scale->ndim() == 5 ? k_scale->shape(3) : 0;
    const mx::Shape want = {k_pool.shape(0), k_pool.shape(1), k_pool.shape(2), G, 2};
    for (const auto* sc : {&*k_scale, &*v_scale}) {
      if (G < 1 || D % G != 0 || sc->shape() != want || sc->dtype() != mx::float32) {
        throw std::invalid_argument("[trillm paged_attention] the int4 pools' (scale, min) must be float32 "
                                    "[num_blocks, bs, Hkv, G, 2], G dividing head_dim");
      }
    }
  }
  if (k_pool.shape(3) * (int4 ? 2 : 1) != D || D % W != 0 || HQ % HKV != 0) {
    throw std::invalid_argument("[trillm paged_attention] head_dim must match and be a multiple of 16, "
                                "and Hq a multiple of Hkv");
  }
  if (block_tables.ndim() != 2 || block_tables.shape(0) != B || context_lens.ndim() != 1 ||
      context_lens.shape(0) != B) {
    throw std::invalid_argument("[trillm paged_attention] block_tables [B, n] and context_lens [B] expected");
  }
  if (window < 0) throw std::invalid_argument("[trillm paged_attention] window must be >= 0");
  if (chunk < 0) throw std::invalid_argument("[trillm paged_attention] chunk must be >= 0 (0: none)");
  if (!(softcap >= 0.0f)) throw std::invalid_argument("[trillm paged_attention] softcap must be >= 0 (0: none)");
  if (sinks && (sinks->ndim() != 1 || sinks->shape(0) != HQ)) {
    throw std::invalid_argument("[trillm paged_attention] sinks must be [Hq]");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {
      mx::contiguous(q, false, stream), k_pool, v_pool,
      mx::contiguous(mx::astype(block_tables, mx::int32, stream), false, stream),
      mx::contiguous(mx::astype(context_lens, mx::int32, stream), false, stream)};
  if (sinks) inputs.push_back(mx::contiguous(mx::astype(*sinks, mx::float32, stream), false, stream));
  if (int8 || int4) {
    inputs.push_back(*k_scale);
    inputs.push_back(*v_scale);
  }
  return mx::array(q.shape(), q.dtype(), std::make_shared<PagedAttention>(stream, scale, window, bool(sinks), softcap, chunk),
                   std::move(inputs));
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const auto& tables = inputs[3];
  const auto& lens = inputs[4];
  auto& out = outputs[0];
  if (!k.flags().row_contiguous || !v.flags().row_contiguous) {
    throw std::runtime_error("[trillm paged_attention] the K/V pools must be row-contiguous");
  }
  const bool int8 = k.dtype() == mx::int8;
  const bool int4 = k.dtype() == mx::uint8;
  const size_t sc = has_sinks_ ? 6 : 5;  // the scales' inputs, after the sinks
  if ((int8 || int4) && (!inputs[sc].flags().row_contiguous || !inputs[sc + 1].flags().row_contiguous)) {
    throw std::runtime_error("[trillm paged_attention] the quantized pools' scales must be row-contiguous");
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  AttnArgs a{};
  a.B = q.shape(0);
  a.HQ = q.shape(1);
  a.L = q.shape(2);
  a.D = q.shape(3);
  a.BS = k.shape(1);
  a.HKV = k.shape(2);
  a.MB = tables.shape(1);
  std::tie(a.num_parts, a.part_size) = attention_partitions(a.B, a.HQ, a.L, a.D, a.MB * a.BS);
  a.hpi = a.L == 1 ? decode_heads_per_item(a.B, a.HQ, a.HKV, a.D, a.num_parts, ThreadPool::get().size())
                   : heads_per_group(a.HQ / a.HKV, a.D);
  a.qt = queries_per_tile(a.L, a.hpi);
  a.num_qtiles = (a.L + a.qt - 1) / a.qt;
  a.scale = scale_;
  a.window = window_;
  a.chunk = chunk_;
  a.softcap = softcap_;
  a.tables = tables.data<int32_t>();
  a.lens = lens.data<int32_t>();
  a.sinks = has_sinks_ ? inputs[5].data<float>() : nullptr;
  a.kscale = int8 || int4 ? inputs[sc].data<float>() : nullptr;
  a.vscale = int8 || int4 ? inputs[sc + 1].data<float>() : nullptr;
  a.groups = int4 ? inputs[sc].shape(3) : 0;

  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);
  // (T, TKV): the queries' dtype and the pools' (the combinations paged_attention admits).
  auto run = [&](auto tq, auto tkv) {
    using T = decltype(tq);
    using TKV = decltype(tkv);
    enc.dispatch([a, qp = q.data<T>(), kp = k.data<TKV>(), vp = v.data<TKV>(), op = out.data<T>()] {
      run_attention<T, TKV>(a, qp, kp, vp, op);
    });
  };
  if (q.dtype() == mx::float32) {
    if (int8) run(float{}, int8_t{});
    else if (int4) run(float{}, uint8_t{});
    else if (k.dtype() == mx::float16) run(float{}, mx::float16_t{});
    else if (k.dtype() == mx::bfloat16) run(float{}, mx::bfloat16_t{});
    else run(float{}, float{});
  } else if (q.dtype() == mx::float16) {
    if (int8) run(mx::float16_t{}, int8_t{});
    else if (int4) run(mx::float16_t{}, uint8_t{});
    else run(mx::float16_t{}, mx::float16_t{});
  } else {
    if (int8) run(mx::bfloat16_t{}, int8_t{});
    else if (int4) run(mx::bfloat16_t{}, uint8_t{});
    else run(mx::bfloat16_t{}, mx::bfloat16_t{});
  }
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm paged_attention] the CPU primitive has no GPU implementation");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return scale_ == o.scale_ && window_ == o.window_ && has_sinks_ == o.has_sinks_ && softcap_ == o.softcap_ &&
         chunk_ == o.chunk_;
}

#endif  // TRILLM_KERNEL_BODIES_ONLY

}  // namespace trillm_cpu
