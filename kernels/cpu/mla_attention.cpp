// Paged MLA attention (DeepSeek V2/V3) as an MLX CPU primitive: decode and prefill chunks over the latent
// cache, read straight from the block pools.
//
// Every query head attends to the one latent sequence (MQA with a wide head): score = scale * (q_latent .
// latent + q_pe . k_pe), output = softmax . latent (the caller applies unembed_out). A work item owns R =
// QT * HPI rows (QT consecutive queries x HPI heads) over one context partition, so each latent token is
// read once for all of them, with an online softmax over tiles of 16 tokens as in paged_attention.cpp, in
// blocks of up to 8 rows (each latent vector loaded once for the block).
// The context is split only as far as needed to give every thread work (few rows, long context): the
// partials' buffer (rows x parts x R floats) stays small where the batch or the chunk already fills the
// cores.
#include <algorithm>
#include <climits>
#include <cmath>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

namespace trillm_cpu {

namespace {

constexpr int MLA_MAX_ROWS = 16;  // rows per item: their q (R + P floats each) and accumulators stay in L1/L2
constexpr int MLA_MIN_PARTITION = 128;  // fewest context tokens per partition

struct MlaArgs {
  int B, H, L, R, P, BS, MB;
  MlaPlan plan;
  float scale;
  const int32_t* tables;
  const int32_t* lens;
};

template <typename T>
inline const float* as_floats(const T* src, float* scratch, int n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int d = 0; d < n; ++d) scratch[d] = static_cast<float>(src[d]);
    return scratch;
  }
}

const vi MLA_IOTA = viota();

// One tile of up to 16 tokens against some rows of one query: their state and the tile's latent / k_pe rows.
struct MlaTile {
  const float* qv;  // [rows, R], scaled
  const float* qe;  // [rows, P], scaled
  float* acc;       // [rows, R]
  float* m;
  float* l;
  int R, P, t0, n, pos;
  vi tpos;
  const float* const* lrow;  // 16 rows (padding lanes repeat a real one)
  const float* const* prow;
};

// Dot products 4 rows x 4 tokens at a time (16 accumulators, each latent vector loaded once per 4 rows),
// one online-softmax update per row, then the latent rows accumulated into all NB rows per load.
template <int NB>
inline void mla_rows(const MlaTile& t, int r0) {
  const int RC = t.R / W, PC = t.P / W;
  alignas(64) vf dots[NB][W];
  constexpr int NB4 = NB < 4 ? NB : 4;  // dot products in row blocks of up to 4 (NB4 x 4 accumulators)
  for (int b0 = 0; b0 < NB; b0 += NB4) {
    for (int j0 = 0; j0 < W; j0 += 4) {
      vf d[NB4][4];
      for (int b = 0; b < NB4; ++b) {
        for (int u = 0; u < 4; ++u) d[b][u] = vf{};
      }
      for (int c = 0; c < RC; ++c) {
        vf k[4];
        for (int u = 0; u < 4; ++u) k[u] = vload(t.lrow[j0 + u] + c * W);
        for (int b = 0; b < NB4; ++b) {
          const vf q = vload(t.qv + static_cast<size_t>(r0 + b0 + b) * t.R + c * W);
          for (int u = 0; u < 4; ++u) d[b][u] += q * k[u];
        }
      }
      for (int c = 0; c < PC; ++c) {
        vf k[4];
        for (int u = 0; u < 4; ++u) k[u] = vload(t.prow[j0 + u] + c * W);
        for (int b = 0; b < NB4; ++b) {
          const vf q = vload(t.qe + static_cast<size_t>(r0 + b0 + b) * t.P + c * W);
          for (int u = 0; u < 4; ++u) d[b][u] += q * k[u];
        }
      }
      for (int b = 0; b < NB4; ++b) {
        for (int u = 0; u < 4; ++u) dots[b0 + b][j0 + u] = d[b][u];
      }
    }
  }
  const vi valid = (t.tpos <= t.pos) & (t.tpos < t.t0 + t.n);
  alignas(64) float pw[NB][W];
  float alpha[NB];
  for (int b = 0; b < NB; ++b) {
    const int r = r0 + b;
    vf s = vsum_lanes(dots[b]);
    s = valid ? s : vsplat(NEG_INF);
    const float mo = t.m[r];
    const float mn = std::max(mo, vmaxf(s));
    alpha[b] = std::exp(mo - mn);
    vf p = vexp(s - mn);
    p = valid ? p : vf{};
    t.l[r] = t.l[r] * alpha[b] + vsum(p);
    t.m[r] = mn;
    vstore(pw[b], p);
  }
  for (int c = 0; c < RC; ++c) {
    vf av[NB];
    for (int b = 0; b < NB; ++b) av[b] = vload(t.acc + static_cast<size_t>(r0 + b) * t.R + c * W) * alpha[b];
    for (int j = 0; j < t.n; ++j) {
      const vf v = vload(t.lrow[j] + c * W);
      for (int b = 0; b < NB; ++b) av[b] += vsplat(pw[b][j]) * v;
    }
    for (int b = 0; b < NB; ++b) vstore(t.acc + static_cast<size_t>(r0 + b) * t.R + c * W, av[b]);
  }
}

template <typename T>
void mla_item(const MlaArgs& a, const T* ql, const T* qp, const T* lat, const T* pe, int item, T* out,
              float* o_part, float* m_part, float* l_part) {
  const MlaPlan& pl = a.plan;
  const int R = a.R, P = a.P;
  const int part = item % pl.num_parts;
  int rest = item / pl.num_parts;
  const int qtile = rest % pl.num_qtiles;
  rest /= pl.num_qtiles;
  const int groups = a.H / pl.hpi;
  const int g = rest % groups;
  const int b = rest / groups;
  const int h0 = g * pl.hpi;
  const int rows = pl.qt * pl.hpi;
  const int ctx = a.lens[b];

  thread_local std::vector<float> buf;
  const size_t need = static_cast<size_t>(rows) * (2 * R + P) + 2 * rows + static_cast<size_t>(W) * (R + P);
  if (buf.size() < need) buf.resize(need);
  float* qv = buf.data();                              // [rows, R], scaled
  float* qe = qv + static_cast<size_t>(rows) * R;      // [rows, P], scaled
  float* acc = qe + static_cast<size_t>(rows) * P;     // [rows, R]
  float* m = acc + static_cast<size_t>(rows) * R;
  float* l = m + rows;
  float* lscr = l + rows;                              // [W, R]: converted latent rows (f16/bf16)
  float* pscr = lscr + static_cast<size_t>(W) * R;     // [W, P]

  int pos[MLA_MAX_ROWS];
  int tok_hi = 0;
  for (int qi = 0; qi < pl.qt; ++qi) {
    const int i = qtile * pl.qt + qi;
    pos[qi] = i < a.L ? ctx - a.L + i : -1;
    if (i < a.L) tok_hi = std::max(tok_hi, pos[qi] + 1);
  }
  tok_hi = std::min(tok_hi, a.MB * a.BS);  // tokens past the table do not exist
  for (int r = 0; r < rows; ++r) {
    const int i = std::min(qtile * pl.qt + r / pl.hpi, a.L - 1);
    const int h = h0 + r % pl.hpi;
    const size_t row = static_cast<size_t>(b * a.H + h) * a.L + i;
    for (int d = 0; d < R; ++d) {
      qv[r * R + d] = static_cast<float>(ql[row * R + d]) * a.scale;
      acc[r * R + d] = 0.0f;
    }
    for (int d = 0; d < P; ++d) qe[r * P + d] = static_cast<float>(qp[row * P + d]) * a.scale;
    m[r] = NEG_INF;
    l[r] = 0.0f;
  }

  const int start = part * pl.part_size;
  const int end = std::min((part + 1) * pl.part_size, tok_hi);
  const int32_t* table = a.tables + static_cast<size_t>(b) * a.MB;
  const float* lrow[W];
  const float* prow[W];
  for (int t0 = start; t0 < end; t0 += W) {
    const int n = std::min(W, end - t0);
    for (int j = 0; j < W; ++j) {
      if (j < n) {
        const int t = t0 + j;
        const size_t slot = static_cast<size_t>(table[t / a.BS]) * a.BS + t % a.BS;
        lrow[j] = as_floats(lat + slot * R, lscr + static_cast<size_t>(j) * R, R);
        prow[j] = as_floats(pe + slot * P, pscr + static_cast<size_t>(j) * P, P);
      } else {  // padding lanes: any row that exists (masked below)
        lrow[j] = lrow[0];
        prow[j] = prow[0];
      }
    }
    const vi tpos = MLA_IOTA + t0;
    for (int r0 = 0; r0 < rows;) {
      // Rows of one query go together, up to 8: each latent vector loaded once for all of them.
      const int qi = r0 / pl.hpi;
      const int nb = std::min({8, pl.hpi - r0 % pl.hpi, rows - r0});
      if (pos[qi] >= t0) {  // else the rows see nothing of this tile
        const MlaTile t{qv, qe, acc, m, l, R, P, t0, n, pos[qi], tpos, lrow, prow};
        switch (nb) {
          case 8: mla_rows<8>(t, r0); break;
          case 7: mla_rows<4>(t, r0); mla_rows<3>(t, r0 + 4); break;
          case 6: mla_rows<4>(t, r0); mla_rows<2>(t, r0 + 4); break;
          case 5: mla_rows<4>(t, r0); mla_rows<1>(t, r0 + 4); break;
          case 4: mla_rows<4>(t, r0); break;
          case 3: mla_rows<3>(t, r0); break;
          case 2: mla_rows<2>(t, r0); break;
          default: mla_rows<1>(t, r0); break;
        }
      }
      r0 += nb;
    }
  }

  for (int r = 0; r < rows; ++r) {
    const int i = qtile * pl.qt + r / pl.hpi;
    if (i >= a.L) continue;
    const int h = h0 + r % pl.hpi;
    const size_t row = static_cast<size_t>(b * a.H + h) * a.L + i;
    const float* ac = acc + static_cast<size_t>(r) * R;
    if (pl.num_parts == 1) {
      const float f = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int d = 0; d < R; ++d) out[row * R + d] = static_cast<T>(ac[d] * f);
    } else {
      const size_t slot = row * pl.num_parts + part;
      std::copy(ac, ac + R, o_part + slot * R);
      m_part[slot] = m[r];
      l_part[slot] = l[r];
    }
  }
}

template <typename T>
void mla_reduce_row(const MlaArgs& a, size_t row, const float* o_part, const float* m_part, const float* l_part,
                    T* out) {
  const int parts = a.plan.num_parts;
  const size_t base = row * parts;
  float M = NEG_INF;
  for (int p = 0; p < parts; ++p) M = std::max(M, m_part[base + p]);
  float S = 0.0f;
  thread_local std::vector<float> o;
  o.assign(a.R, 0.0f);
  for (int p = 0; p < parts; ++p) {
    const float c = std::exp(m_part[base + p] - M);
    S += l_part[base + p] * c;
    const float* op = o_part + (base + p) * a.R;
    for (int d = 0; d < a.R; ++d) o[d] += op[d] * c;
  }
  const float f = S > 0.0f ? 1.0f / S : 0.0f;
  for (int d = 0; d < a.R; ++d) out[row * a.R + d] = static_cast<T>(o[d] * f);
}

template <typename T>
void run_mla(const MlaArgs& a, const T* ql, const T* qp, const T* lat, const T* pe, T* out) {
  const MlaPlan& pl = a.plan;
  const int items = a.B * (a.H / pl.hpi) * pl.num_qtiles * pl.num_parts;
  const size_t rows = static_cast<size_t>(a.B) * a.H * a.L;
  std::vector<float> o_part, m_part, l_part;
  if (pl.num_parts > 1) {
    o_part.resize(rows * pl.num_parts * a.R);
    m_part.assign(rows * pl.num_parts, NEG_INF);
    l_part.assign(rows * pl.num_parts, 0.0f);
  }
  float *op = o_part.data(), *mp = m_part.data(), *lp = l_part.data();
  auto& pool = ThreadPool::get();
  pool.parallel_for(items, [&](int item) { mla_item<T>(a, ql, qp, lat, pe, item, out, op, mp, lp); });
  if (pl.num_parts > 1) {
    const int chunks = static_cast<int>(std::min<size_t>(rows, static_cast<size_t>(pool.size()) * 4));
    pool.parallel_for(chunks, [&](int c) {
      for (size_t row = c; row < rows; row += chunks) mla_reduce_row(a, row, op, mp, lp, out);
    });
  }
}

}  // namespace

MlaPlan mla_plan(int batch, int num_heads, int num_queries, int max_tokens, int threads) {
  MlaPlan p{};
  // Heads per item: the largest divisor of H up to MLA_MAX_ROWS; in decode a smaller one (down to 4) when
  // the batch alone leaves threads idle, since splitting heads costs only latent re-reads from cache.
  std::vector<int> divisors;
  for (int h = std::min(num_heads, MLA_MAX_ROWS); h >= 1; --h) {
    if (num_heads % h == 0) divisors.push_back(h);
  }
  p.hpi = divisors.front();
  if (num_queries == 1) {
    for (int h : divisors) {
      if (h < 4) break;
      p.hpi = h;
      if (static_cast<long>(batch) * (num_heads / h) >= 4L * threads) break;
    }
  }
  p.qt = std::max(1, std::min(MLA_MAX_ROWS / p.hpi, num_queries));
  p.num_qtiles = (num_queries + p.qt - 1) / p.qt;
  const long items = static_cast<long>(batch) * (num_heads / p.hpi) * p.num_qtiles;
  const int most = std::max(1, (max_tokens + MLA_MIN_PARTITION - 1) / MLA_MIN_PARTITION);
  const long wanted = (4L * threads + items - 1) / items;
  p.num_parts = static_cast<int>(std::max(1L, std::min<long>(most, wanted)));
  p.part_size = (max_tokens + p.num_parts - 1) / p.num_parts;
  p.part_size = (p.part_size + W - 1) / W * W;
  p.num_parts = std::max(1, (max_tokens + p.part_size - 1) / p.part_size);
  return p;
}

mx::array mla_attention(const mx::array& q_latent, const mx::array& q_pe, const mx::array& latent_pool,
                        const mx::array& pe_pool, const mx::array& block_tables, const mx::array& context_lens,
                        float scale, mx::StreamOrDevice s) {
  const char* who = "[trillm mla_attention] ";
  if (q_latent.ndim() != 4 || q_pe.ndim() != 4 || latent_pool.ndim() != 4 || pe_pool.ndim() != 4) {
    throw std::invalid_argument(std::string(who) + "q_latent, q_pe and the pools must be 4-D");
  }
  const auto dt = q_latent.dtype();
  if (q_pe.dtype() != dt || latent_pool.dtype() != dt || pe_pool.dtype() != dt) {
    throw std::invalid_argument(std::string(who) + "q_latent, q_pe and the pools must share one dtype");
  }
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) {
    throw std::invalid_argument(std::string(who) + "dtype must be float32, float16 or bfloat16");
  }
  const int B = q_latent.shape(0), H = q_latent.shape(1), L = q_latent.shape(2), R = q_latent.shape(3);
  const int P = q_pe.shape(3);
  if (q_pe.shape(0) != B || q_pe.shape(1) != H || q_pe.shape(2) != L) {
    throw std::invalid_argument(std::string(who) + "q_pe must be [B, H, L, P] like q_latent");
  }
  if (latent_pool.shape(2) != 1 || pe_pool.shape(2) != 1 || latent_pool.shape(3) != R || pe_pool.shape(3) != P ||
      latent_pool.shape(0) != pe_pool.shape(0) || latent_pool.shape(1) != pe_pool.shape(1)) {
    throw std::invalid_argument(std::string(who) + "pools must be [num_blocks, bs, 1, R] and [num_blocks, bs, 1, P]");
  }
  if (R % W != 0 || P % W != 0) {
    throw std::invalid_argument(std::string(who) + "kv_lora_rank and the RoPE dim must be multiples of 16");
  }
  if (block_tables.ndim() != 2 || block_tables.shape(0) != B || context_lens.ndim() != 1 ||
      context_lens.shape(0) != B) {
    throw std::invalid_argument(std::string(who) + "block_tables [B, n] and context_lens [B] expected");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {
      mx::contiguous(q_latent, false, stream), mx::contiguous(q_pe, false, stream), latent_pool, pe_pool,
      mx::contiguous(mx::astype(block_tables, mx::int32, stream), false, stream),
      mx::contiguous(mx::astype(context_lens, mx::int32, stream), false, stream)};
  return mx::array(q_latent.shape(), dt, std::make_shared<MlaAttention>(stream, scale), std::move(inputs));
}

void MlaAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& ql = inputs[0];
  const auto& qp = inputs[1];
  const auto& lat = inputs[2];
  const auto& pe = inputs[3];
  const auto& tables = inputs[4];
  const auto& lens = inputs[5];
  auto& out = outputs[0];
  if (!lat.flags().row_contiguous || !pe.flags().row_contiguous) {
    throw std::runtime_error("[trillm mla_attention] the latent and k_pe pools must be row-contiguous");
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  MlaArgs a{};
  a.B = ql.shape(0);
  a.H = ql.shape(1);
  a.L = ql.shape(2);
  a.R = ql.shape(3);
  a.P = qp.shape(3);
  a.BS = lat.shape(1);
  a.MB = tables.shape(1);
  a.plan = mla_plan(a.B, a.H, a.L, a.MB * a.BS, ThreadPool::get().size());
  a.scale = scale_;
  a.tables = tables.data<int32_t>();
  a.lens = lens.data<int32_t>();

  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);
  if (ql.dtype() == mx::float32) {
    enc.dispatch([a, q1 = ql.data<float>(), q2 = qp.data<float>(), lp = lat.data<float>(), pp = pe.data<float>(),
                  op = out.data<float>()] { run_mla<float>(a, q1, q2, lp, pp, op); });
  } else if (ql.dtype() == mx::float16) {
    using F = mx::float16_t;
    enc.dispatch([a, q1 = ql.data<F>(), q2 = qp.data<F>(), lp = lat.data<F>(), pp = pe.data<F>(),
                  op = out.data<F>()] { run_mla<F>(a, q1, q2, lp, pp, op); });
  } else {
    using F = mx::bfloat16_t;
    enc.dispatch([a, q1 = ql.data<F>(), q2 = qp.data<F>(), lp = lat.data<F>(), pp = pe.data<F>(),
                  op = out.data<F>()] { run_mla<F>(a, q1, q2, lp, pp, op); });
  }
}

void MlaAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm mla_attention] the CPU primitive has no GPU implementation");
}

bool MlaAttention::is_equivalent(const mx::Primitive& other) const {
  return scale_ == static_cast<const MlaAttention&>(other).scale_;
}

}  // namespace trillm_cpu
