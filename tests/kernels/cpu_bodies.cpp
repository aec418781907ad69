// The CPU kernels' bodies alone (no mlx), checked against scalar references: built for any ISA by
// tests/kernels/test_cpu_isa.py (natively for AVX2, cross-compiled for aarch64 and run under qemu-user for
// NEON), so each ISA's vector width and register tiles are checked where no such CPU is at hand.
// Prints one line per check; exits 1 on the first mismatch.
#define TRILLM_KERNEL_BODIES_ONLY 1

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gated_delta.cpp"
#include "linear.cpp"
#include "paged_attention.cpp"
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

// Paged attention with shuffled blocks against a dense softmax per (row, head, query).
void check_attention(int B, int HQ, int HKV, int D, int L, int ctx, int window) {
  const int BS = 16, MB = (ctx + BS - 1) / BS, NBLK = B * MB + 1;
  auto q = randn(static_cast<size_t>(B) * HQ * L * D);
  auto k = randn(static_cast<size_t>(NBLK) * BS * HKV * D), v = randn(k.size());
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
  a.tables = tables.data();
  a.lens = lens.data();
  std::vector<float> out(q.size());
  run_attention<float>(a, q.data(), k.data(), v.data(), out.data());
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
          mx = std::max(mx, s[t]);
        }
        double denom = 0.0;
        for (int t = lo; t <= pos; ++t) denom += std::exp(s[t] - mx);
        double* o = want.data() + ((static_cast<size_t>(b) * HQ + h) * L + i) * D;
        for (int t = lo; t <= pos; ++t) {
          const double p = std::exp(s[t] - mx) / denom;
          for (int e = 0; e < D; ++e) o[e] += p * v[at(t) + e];
        }
      }
    }
  }
  char what[112];
  std::snprintf(what, sizeof what, "paged_attention B=%d Hq=%d Hkv=%d D=%d L=%d ctx=%d window=%d", B, HQ, HKV, D,
                L, ctx, window);
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
  check_gated_delta(2, 1, 2, 4, 128, 64, false);  // decode, GQA 2, Qwen3.5's Dk
  check_gated_delta(3, 9, 1, 2, 64, 16, true);    // a scan, a per-channel gate
  check_gated_delta(1, 5, 2, 2, 24, 8, false);    // Dk off every ISA's lanes: the scalar rows
  std::printf(failures ? "%d check(s) failed\n" : "all checks passed\n", failures);
  return failures ? 1 : 0;
}
