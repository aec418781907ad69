// The CPU kernels' bodies alone (no mlx), checked against scalar references: built for every x86 ISA the CPU
// runs by tests/kernels/test_cpu_isa.py, and cross-compiled for aarch64 and run under qemu-user for NEON by
// tests/kernels/test_neon_cross.py, so each ISA's vector width and register tiles are checked where no such
// CPU is at hand.
// Prints one line per check; exits 1 if any failed.
#define TRILLM_KERNEL_BODIES_ONLY 1

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

// The compiler's IEEE half: __fp16 on aarch64 (GCC 12's C++ has no _Float16 there), else _Float16.
#if defined(__ARM_FP16_FORMAT_IEEE)
using half_t = __fp16;
#else
using half_t = _Float16;
#endif

// Stand-ins for MLX's 16-bit float types (their bits only), for quant_linear's fp16/bf16 scales.
namespace mlx::core {
struct float16_t {
  uint16_t bits;
  explicit operator float() const {
    half_t h;
    std::memcpy(&h, &bits, sizeof h);
    return static_cast<float>(h);
  }
};
struct bfloat16_t {
  uint16_t bits;
};
}  // namespace mlx::core
namespace mx = mlx::core;

#include "gated_delta.cpp"
#include "linear.cpp"
#include "paged_attention.cpp"
#include "quant_linear.cpp"
#include "rms_norm.cpp"
#include "rope.cpp"
#include "silu_mul.cpp"
#include "thread_pool.cpp"

using namespace trillm_cpu;

namespace {

std::mt19937 rng(1234);

std::vector<float> randn(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

int failures = 0;

void expect_close(const char* what, const std::vector<float>& got, const std::vector<double>& want, double rtol,
                  double atol) {
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]) - rtol * std::fabs(want[i]);
    if (!(err <= worst)) {  // NaN counts as a mismatch
      worst = std::isnan(err) ? INFINITY : err;
      at = i;
    }
  }
  const bool ok = worst <= atol;
  std::printf("%s %s (%zu values%s)\n", ok ? "ok  " : "FAIL", what, want.size(),
              ok ? "" : (", worst at " + std::to_string(at) + ": " + std::to_string(got[at]) + " vs " +
                         std::to_string(want[at])).c_str());
  failures += !ok;
}

void check_simd() {
  vf in[W];
  std::vector<double> want(W);
  std::vector<float> got(W);
  for (int j = 0; j < W; ++j) {
    auto v = randn(W);
    in[j] = vload(v.data());
    for (float x : v) want[j] += x;
  }
  const vf s = vsum_lanes(in);
  for (int j = 0; j < W; ++j) got[j] = s[j];
  expect_close("vsum_lanes", got, want, 1e-6, 1e-5);
  got.assign(1, vsum(in[0]));
  want.assign(1, 0.0);
  for (int j = 0; j < W; ++j) want[0] += in[0][j];
  expect_close("vsum", got, want, 1e-6, 1e-5);
  std::vector<float> xs(16 * W);
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = -87.0f + 175.0f * static_cast<float>(i) / xs.size();
  got.resize(xs.size());
  want.resize(xs.size());
  for (size_t i = 0; i < xs.size(); i += W) {
    vstore(got.data() + i, vexp(vload(xs.data() + i)));
    for (int j = 0; j < W; ++j) want[i + j] = std::exp(static_cast<double>(xs[i + j]));
  }
  expect_close("vexp", got, want, 2e-6, 0.0);
}

void check_linear(int M, int N, int K, int ldw_pad) {
  const size_t ldw = K + ldw_pad;  // a row slice of a wider buffer, read through its stride
  auto x = randn(static_cast<size_t>(M) * K), w = randn(N * ldw, 1.0f / std::sqrt(static_cast<float>(K)));
  std::vector<float> y(static_cast<size_t>(M) * N);
  linear_impl(Args{x.data(), static_cast<size_t>(K), w.data(), ldw, y.data(), M, N, K});
  std::vector<double> want(y.size());
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      double s = 0.0;
      for (int k = 0; k < K; ++k) s += static_cast<double>(x[m * K + k]) * w[n * ldw + k];
      want[m * N + n] = s;
    }
  }
  char what[96];
  std::snprintf(what, sizeof what, "linear M=%d N=%d K=%d ldw=%zu", M, N, K, ldw);
  expect_close(what, y, want, 1e-4, 1e-4);
}

void check_rms_norm(size_t rows, int D) {
  auto x = randn(rows * D), w = randn(D);
  std::vector<float> y(x.size());
  rms_rows(x.data(), w.data(), y.data(), rows, D, 1e-5f);
  std::vector<double> want(y.size());
  for (size_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int d = 0; d < D; ++d) ss += static_cast<double>(x[r * D + d]) * x[r * D + d];
    const double inv = 1.0 / std::sqrt(ss / D + 1e-5);
    for (int d = 0; d < D; ++d) want[r * D + d] = x[r * D + d] * inv * w[d];
  }
  char what[64];
  std::snprintf(what, sizeof what, "rms_norm rows=%zu D=%d", rows, D);
  expect_close(what, y, want, 1e-5, 1e-5);
}

void check_silu_mul(size_t n) {
  auto g = randn(n, 3.0f), u = randn(n);
  std::vector<float> y(n);
  silu_mul_impl(g.data(), u.data(), y.data(), n);
  std::vector<double> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
  char what[64];
  std::snprintf(what, sizeof what, "silu_mul n=%zu", n);
  expect_close(what, y, want, 1e-5, 1e-6);
}

void check_rope(bool traditional) {
  const int B = 2, H = 3, L = 5, D = 64, dims = 64;
  auto x = randn(static_cast<size_t>(B) * H * L * D);
  const int32_t offsets[2] = {7, 130};
  RopeArgs a{B, H, L, D, dims, int64_t{H} * L * D, int64_t{L} * D, D, 1};
  a.traditional = traditional;
  a.base = 10000.0f;
  a.scale = 1.0f;
  a.num_offsets = 2;
  std::vector<float> y(x.size());
  rope_impl(a, x.data(), offsets, y.data());
  std::vector<double> want(y.size());
  const int half = dims / 2;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int l = 0; l < L; ++l) {
        const size_t row = ((static_cast<size_t>(b) * H + h) * L + l) * D;
        for (int i = 0; i < half; ++i) {
          const double theta = (offsets[b] + l) * std::pow(10000.0, -static_cast<double>(i) / half);
          const int i1 = traditional ? 2 * i : i, i2 = traditional ? 2 * i + 1 : i + half;
          want[row + i1] = x[row + i1] * std::cos(theta) - x[row + i2] * std::sin(theta);
          want[row + i2] = x[row + i1] * std::sin(theta) + x[row + i2] * std::cos(theta);
        }
      }
    }
  }
  expect_close(traditional ? "rope traditional" : "rope", y, want, 1e-4, 1e-4);
}

// quant_linear's prefill rows hand a dequantized block to BLAS: row-major C = A . B^T, the one call it makes.
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  if (order != 101 || trans_a != 111 || trans_b != 112) std::abort();
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int e = 0; e < k; ++e) acc += static_cast<double>(a[i * lda + e]) * b[j * ldb + e];
      c[i * ldc + j] = static_cast<float>(alpha * acc + (beta == 0.0f ? 0.0 : beta * c[i * ldc + j]));
    }
  }
}

// A float rounded into a scale dtype, and (scale_value, not the kernel's own conversion) its value.
template <typename S>
S to_scale(float f) {
  if constexpr (std::is_same_v<S, mx::float16_t>) {
    const half_t h = static_cast<half_t>(f);
    S s;
    std::memcpy(&s.bits, &h, sizeof h);
    return s;
  } else if constexpr (std::is_same_v<S, mx::bfloat16_t>) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return S{static_cast<uint16_t>(u >> 16)};
  } else {
    return f;
  }
}
template <typename S>
double scale_value(S s) {
  if constexpr (std::is_same_v<S, mx::bfloat16_t>) {
    const uint32_t u = static_cast<uint32_t>(s.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  } else {
    return static_cast<float>(s);
  }
}

// y = x . dequantize(w).T through quant_linear, MLX's packing (q little-endian in uint32 words along K), against
// the dequantized weights in double. x_bits 32, the fp32 paths: M <= max_rows register tiles (M <= the tile's
// rows) or fp32 tiles over dequantized bands; else the dequantize-then-sgemm rows. x_bits 16 or 8, the integer
// path (every row count on x86, M <= max_rows elsewhere): against x rounded per block of 32 as the kernel
// rounds it, and each row's y bit for bit what that row alone gets.
template <typename S>
void check_quant_linear(int M, int N, int K, int G, int bits, int max_rows, const char* sname, int x_bits = 32) {
  std::uniform_int_distribution<uint32_t> qd(0, (1u << bits) - 1);
  std::vector<uint32_t> packed(static_cast<size_t>(N) * K * bits / 32, 0);
  std::vector<uint32_t> q(static_cast<size_t>(N) * K);
  for (int n = 0; n < N; ++n) {
    for (int k = 0; k < K; ++k) {
      const uint32_t v = q[static_cast<size_t>(n) * K + k] = qd(rng);
      const size_t bit = (static_cast<size_t>(n) * K + k) * bits;
      packed[bit / 32] |= v << (bit % 32);
    }
  }
  const size_t ng = static_cast<size_t>(N) * (K / G);
  auto sraw = randn(ng, 0.02f), braw = randn(ng, 0.1f);
  std::vector<S> sc(ng), bi(ng);
  for (size_t i = 0; i < ng; ++i) sc[i] = to_scale<S>(sraw[i]), bi[i] = to_scale<S>(braw[i]);
  auto x = randn(static_cast<size_t>(M) * K);
  std::vector<float> y(static_cast<size_t>(M) * N);
  const QArgs<S> a{x.data(), reinterpret_cast<const uint8_t*>(packed.data()), sc.data(), bi.data(), y.data(),
                   M, N, K, G, bits};
  run(a, max_rows, x_bits);
  std::vector<float> xr = x;  // x as the integer path sees it
  if (x_bits < 32) {
    const float top = x_bits == 8 ? 127.0f : 32767.0f;
    for (size_t b = 0; b < x.size(); b += 32) {
      float amax = 0.0f;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[b + k]));
      const float inv = amax > 0.0f ? top / amax : 0.0f;
      for (int k = 0; k < 32; ++k) xr[b + k] = std::nearbyint(x[b + k] * inv) * (amax / top);
    }
  }
  std::vector<double> want(y.size());
  for (int n = 0; n < N; ++n) {
    for (int k = 0; k < K; ++k) {
      const size_t g = static_cast<size_t>(n) * (K / G) + k / G;
      const double w = scale_value(sc[g]) * q[static_cast<size_t>(n) * K + k] + scale_value(bi[g]);
      for (int m = 0; m < M; ++m) want[static_cast<size_t>(m) * N + n] += w * xr[static_cast<size_t>(m) * K + k];
    }
  }
  char what[128];
  std::snprintf(what, sizeof what, "quant_linear %d-bit M=%d N=%d K=%d G=%d max_rows=%d %s scales x_bits=%d", bits, M,
                N, K, G, max_rows, sname, x_bits);
  expect_close(what, y, want, 1e-4, 1e-4);
  if (x_bits == 32 || M == 1) return;
  bool same = true;
  for (int m = 0; m < M; ++m) {
    std::vector<float> one(N);
    QArgs<S> r = a;
    r.x = x.data() + static_cast<size_t>(m) * K, r.y = one.data(), r.M = 1;
    run(r, max_rows, x_bits);
    same = same && std::memcmp(one.data(), y.data() + static_cast<size_t>(m) * N, N * sizeof(float)) == 0;
  }
  std::printf("%s %s: each row alone bit for bit\n", same ? "ok  " : "FAIL", what);
  failures += !same;
}

// Paged attention with shuffled blocks against a dense softmax per (row, head, query).
// TKV: the pools' dtype: float, half_t (float16 under float32 queries), int8 with a float32 scale per
// token and KV head, or uint8 (the int4 cache: two values a byte, low nibble first) with a float32
// (scale, min) per token, KV head and group of D / G values, G = max(1, D / 32) as kv_write.int4_groups
// (the reference reads the values the kernel reads). Optionally sinks and soft-capping.
template <typename TKV = float>
void check_attention(int B, int HQ, int HKV, int D, int L, int ctx, int window, bool sinks = false,
                     float softcap = 0.0f) {
  const int BS = 16, MB = (ctx + BS - 1) / BS, NBLK = B * MB + 1;
  constexpr bool int4 = std::is_same_v<TKV, uint8_t>;
  const int G = int4 ? std::max(1, D / 32) : 0;
  auto q = randn(static_cast<size_t>(B) * HQ * L * D);
  std::vector<float> k = randn(static_cast<size_t>(NBLK) * BS * HKV * D), v = randn(k.size());
  std::vector<TKV> kp(int4 ? k.size() / 2 : k.size()), vp(kp.size());
  std::vector<float> ks, vs, sk = randn(HQ);
  if constexpr (int4) {
    ks = randn(static_cast<size_t>(NBLK) * BS * HKV * G * 2), vs = randn(ks.size());
    for (auto* s : {&ks, &vs}) {
      for (size_t i = 0; i < s->size(); i += 2) (*s)[i] = 0.01f + std::fabs((*s)[i]) / 8.0f;  // scale >= 0
    }
    std::uniform_int_distribution<int> qd(0, 15);
    for (size_t i = 0; i < k.size(); ++i) {
      const int qk = qd(rng), qv = qd(rng);
      const int shift = 4 * static_cast<int>(i % 2);
      kp[i / 2] = static_cast<uint8_t>(kp[i / 2] | (qk << shift));
      vp[i / 2] = static_cast<uint8_t>(vp[i / 2] | (qv << shift));
      const size_t g = (i / D) * G + (i % D) / (D / G);  // the (slot, head)'s group of element i
      k[i] = qk * ks[2 * g] + ks[2 * g + 1], v[i] = qv * vs[2 * g] + vs[2 * g + 1];
    }
  } else if constexpr (std::is_same_v<TKV, int8_t>) {
    ks = randn(static_cast<size_t>(NBLK) * BS * HKV), vs = randn(ks.size());
    std::uniform_int_distribution<int> qd(-127, 127);
    for (auto* s : {&ks, &vs}) {
      for (auto& e : *s) e = 0.01f + std::fabs(e) / 64.0f;
    }
    for (size_t i = 0; i < k.size(); ++i) {
      kp[i] = static_cast<int8_t>(qd(rng)), vp[i] = static_cast<int8_t>(qd(rng));
      k[i] = kp[i] * ks[i / D], v[i] = vp[i] * vs[i / D];  // one scale per (slot, head): D values
    }
  } else {
    for (size_t i = 0; i < k.size(); ++i) {
      kp[i] = static_cast<TKV>(k[i]), vp[i] = static_cast<TKV>(v[i]);
      k[i] = static_cast<float>(kp[i]), v[i] = static_cast<float>(vp[i]);
    }
  }
  std::vector<int32_t> tables(static_cast<size_t>(B) * MB), lens(B, ctx);
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>((i * 7 + 1) % (NBLK - 1) + 1);
  AttnArgs a{};
  a.B = B, a.HQ = HQ, a.L = L, a.D = D, a.BS = BS, a.HKV = HKV, a.MB = MB;
  std::tie(a.num_parts, a.part_size) = attention_partitions(B, HQ, L, D, MB * BS);
  a.hpi = L == 1 ? decode_heads_per_item(B, HQ, HKV, D, a.num_parts, ThreadPool::get().size())
                 : heads_per_group(HQ / HKV, D);
  a.qt = queries_per_tile(L, a.hpi);
  a.num_qtiles = (L + a.qt - 1) / a.qt;
  a.scale = 1.0f / std::sqrt(static_cast<float>(D));
  a.window = window;
  a.softcap = softcap;
  a.tables = tables.data();
  a.lens = lens.data();
  a.sinks = sinks ? sk.data() : nullptr;
  a.kscale = ks.empty() ? nullptr : ks.data();
  a.vscale = vs.empty() ? nullptr : vs.data();
  a.groups = G;
  std::vector<float> out(q.size());
  run_attention<float, TKV>(a, q.data(), kp.data(), vp.data(), out.data());
  std::vector<double> want(out.size());
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < HQ; ++h) {
      const int kvh = h / (HQ / HKV);
      for (int i = 0; i < L; ++i) {
        const int pos = ctx - L + i, lo = window > 0 ? std::max(0, pos - window + 1) : 0;
        const float* qr = q.data() + ((static_cast<size_t>(b) * HQ + h) * L + i) * D;
        std::vector<double> s(pos + 1, -INFINITY);
        double mx = -INFINITY;
        auto at = [&](int t) { return ((static_cast<size_t>(tables[b * MB + t / BS]) * BS + t % BS) * HKV + kvh) * D; };
        for (int t = lo; t <= pos; ++t) {
          double d = 0.0;
          for (int e = 0; e < D; ++e) d += static_cast<double>(qr[e]) * k[at(t) + e];
          s[t] = d * a.scale;
          if (softcap > 0.0f) s[t] = softcap * std::tanh(s[t] / softcap);
          mx = std::max(mx, s[t]);
        }
        if (sinks) mx = std::max(mx, static_cast<double>(sk[h]));
        double denom = sinks ? std::exp(sk[h] - mx) : 0.0;
        for (int t = lo; t <= pos; ++t) denom += std::exp(s[t] - mx);
        double* o = want.data() + ((static_cast<size_t>(b) * HQ + h) * L + i) * D;
        for (int t = lo; t <= pos; ++t) {
          const double p = std::exp(s[t] - mx) / denom;
          for (int e = 0; e < D; ++e) o[e] += p * v[at(t) + e];
        }
      }
    }
  }
  const char* pool = int4                             ? "int4"
                     : std::is_same_v<TKV, int8_t>    ? "int8"
                     : std::is_same_v<TKV, float>     ? "fp32"
                                                      : "fp16";
  char what[160];
  std::snprintf(what, sizeof what, "paged_attention %s KV B=%d Hq=%d Hkv=%d D=%d L=%d ctx=%d window=%d%s%s "
                "hpi=%d", pool, B, HQ, HKV, D, L, ctx, window, sinks ? " sinks" : "",
                softcap > 0.0f ? " softcap" : "", a.hpi);
  expect_close(what, out, want, 1e-4, 1e-4);
}

}  // namespace

// The gated delta rule over T tokens, against the recurrence in double (a scalar or per-channel gate, GQA,
// a masked token), on fp32 inputs: each ISA's row tiles (and the scalar rows for a Dk off the lanes).
void check_gated_delta(int B, int T, int Hk, int Hv, int Dk, int Dv, bool vec_g) {
  auto q = randn(size_t(B) * T * Hk * Dk, 0.1f), k = randn(size_t(B) * T * Hk * Dk, 0.1f);
  auto v = randn(size_t(B) * T * Hv * Dv), st = randn(size_t(B) * Hv * Dv * Dk);
  auto graw = randn(size_t(B) * T * Hv * (vec_g ? Dk : 1)), braw = randn(size_t(B) * T * Hv);
  std::vector<float> g(graw.size()), beta(braw.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = std::exp(-std::fabs(graw[i]));
  for (size_t i = 0; i < beta.size(); ++i) beta[i] = 1.0f / (1.0f + std::exp(-braw[i]));
  std::unique_ptr<bool[]> mask(new bool[size_t(B) * T]);
  for (int i = 0; i < B * T; ++i) mask[i] = !(i % T == T - 1 && i / T == B - 1 && T > 1);  // last row's last token
  std::vector<float> y(size_t(B) * T * Hv * Dv), out(st.size());
  GdnArgs a{B, T, Hk, Hv, Dk, Dv, vec_g, g.data(), beta.data(), mask.get(), st.data(), out.data()};
  gated_delta_run<float>(a, q.data(), k.data(), v.data(), y.data());
  std::vector<double> wy(y.size()), ws(st.begin(), st.end());
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hv; ++h) {
      const int hk = h / (Hv / Hk);
      for (int t = 0; t < T; ++t) {
        const size_t sh = (size_t(b) * T + t) * Hv + h;
        const float* qt = &q[((size_t(b) * T + t) * Hk + hk) * Dk];
        const float* kt = &k[((size_t(b) * T + t) * Hk + hk) * Dk];
        for (int r = 0; r < Dv; ++r) {
          double* row = &ws[((size_t(b) * Hv + h) * Dv + r) * Dk];
          std::vector<double> nr(Dk);
          double kv = 0.0, o = 0.0;
          for (int i = 0; i < Dk; ++i) kv += (nr[i] = row[i] * g[vec_g ? sh * Dk + i : sh]) * kt[i];
          const double delta = (v[sh * Dv + r] - kv) * beta[sh];
          for (int i = 0; i < Dk; ++i) o += (nr[i] += kt[i] * delta) * qt[i];
          wy[sh * Dv + r] = o;
          if (mask[size_t(b) * T + t]) std::copy(nr.begin(), nr.end(), row);
        }
      }
    }
  const std::string what = "gated_delta B=" + std::to_string(B) + " T=" + std::to_string(T) + " Dk=" +
                           std::to_string(Dk) + (vec_g ? " vector gate" : "");
  expect_close((what + " y").c_str(), y, wy, 1e-4, 1e-4);
  expect_close((what + " state").c_str(), out, ws, 1e-4, 1e-4);
}

int main() {
  std::printf("ISA %s: %d floats per vector, %d vector registers, %d threads\n", TRILLM_SIMD, W, NREG,
              ThreadPool::get().size());
  check_simd();
  for (int M : {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 24, 31, 32, 33}) check_linear(M, 101, 64, 0);
  for (int M : {1, 3, 8, 12, 32}) check_linear(M, 150, 576, 48);
  check_linear(4, 97, 1536, 0);
  check_rms_norm(7, 576);
  check_rms_norm(3, 100);  // a tail past the last whole vector
  check_silu_mul(1000);
  check_silu_mul(70001);
  check_rope(false);
  check_rope(true);
  check_attention(2, 9, 3, 64, 1, 37, 0);     // decode, SmolLM2's heads
  check_attention(3, 8, 2, 128, 1, 600, 0);   // decode across two partitions
  check_attention(1, 4, 4, 64, 21, 50, 0);    // a prefill chunk over a cached prefix
  check_attention(2, 4, 2, 80, 5, 40, 16);    // D not a power of two, a sliding window
  check_attention(8, 8, 2, 64, 1, 40, 0);     // decode items over both KV heads (a batch to fill the cores)
  check_attention<int8_t>(2, 9, 3, 64, 1, 37, 0);    // the int8 cache: decode
  check_attention<int8_t>(8, 8, 2, 64, 1, 40, 0);    // each KV head's scales in an item over both
  check_attention<int8_t>(3, 8, 2, 128, 1, 600, 0);  // across two partitions
  check_attention<int8_t>(1, 4, 2, 80, 7, 45, 0);    // a prefill chunk, D off the tiles
  check_attention<uint8_t>(2, 9, 3, 64, 1, 37, 0);    // the int4 cache: decode, two groups per head
  check_attention<uint8_t>(8, 8, 2, 64, 1, 40, 0);    // each KV head's groups in an item over both
  check_attention<uint8_t>(3, 8, 2, 128, 1, 600, 0);  // across two partitions
  check_attention<uint8_t>(1, 4, 2, 80, 7, 45, 0);    // a prefill chunk, groups of 40: the scalar decode
  check_attention<uint8_t>(2, 4, 2, 16, 5, 40, 16, true, 30.0f);  // one group of 16, window, sinks, softcap
  check_attention<half_t>(2, 8, 2, 128, 3, 70, 0);  // a float16 cache under float32 queries
  check_attention(2, 8, 2, 64, 1, 600, 0, true, 30.0f);  // sinks (through the partition merge), soft-capping
  check_attention(1, 4, 4, 64, 6, 50, 20, true, 0.0f);   // sinks with one partition
  for (int bits : {4, 8}) {
    for (int M : {1, 2, 3, 5, 9}) check_quant_linear<float>(M, 37, 256, 64, bits, 16, "fp32");
    check_quant_linear<float>(20, 37, 256, 64, bits, 16, "fp32");  // past max_rows: dequantize + sgemm
    check_quant_linear<mx::float16_t>(1, 70, 512, 32, bits, 16, "fp16");
    check_quant_linear<mx::bfloat16_t>(4, 33, 384, 128, bits, 16, "bf16");
  }
  check_quant_linear<mx::float16_t>(6, 48, 2048, 32, 4, 16, "fp16");  // several K chunks per dequantized band
  for (int bits : {4, 8}) {
    for (int xb : {16, 8}) {
      for (int M : {1, 3, 9}) check_quant_linear<mx::float16_t>(M, 37, 256, 32, bits, 16, "fp16", xb);
      check_quant_linear<float>(5, 20, 384, 128, bits, 16, "fp32", xb);  // groups of four blocks
      // 18 groups (the lanes' 16-byte scale loads and a scalar rest), 2.5 lane groups of rows; on x86 (the
      // integer path at every row count) two row tiles, elsewhere within max_rows
#if defined(TRILLM_Q8_DOT)
      check_quant_linear<mx::bfloat16_t>(70, 40, 576, 32, bits, 16, "bf16", xb);
#else
      check_quant_linear<mx::bfloat16_t>(9, 40, 576, 32, bits, 16, "bf16", xb);
#endif
    }
  }
  check_gated_delta(2, 1, 2, 4, 128, 64, false);  // decode, GQA 2, Qwen3.5's Dk
  check_gated_delta(3, 9, 1, 2, 64, 16, true);    // a scan, a per-channel gate
  check_gated_delta(1, 5, 2, 2, 24, 8, false);    // Dk off every ISA's lanes: the scalar rows
  std::printf(failures ? "%d check(s) failed\n" : "all checks passed\n", failures);
  return failures ? 1 : 0;
}
