// Small-M matmul y = x @ w.T as an MLX CPU primitive, for decode (M = batch rows, 1 to ~64).
//
// MLX sends every matmul to cblas_sgemm; for a few rows OpenBLAS 0.3.21 reads the weights at ~7-12 GB/s and
// at 8-32 rows it stays far from both the bandwidth and the FMA bound. Here the weight rows are cut into
// bands, taken dynamically by the cores; a band is streamed from memory once, and every x row reuses it
// from cache: tiles of MT x rows by NT weight rows keep MT * NT dot products in registers (loads: MT + NT
// vectors per MT * NT FMAs), reduced at the end by one transpose-add tree (simd.h). With one x row each
// weight row is read front to back (one sequential stream for the prefetchers).
//
// Past 8 rows the dot-product tiles spend their time on loads of x and horizontal sums, and OpenBLAS's
// packed sgemm is faster. There x is transposed once into xt[K][MP] (MP = rows rounded up to 16, zeros
// below), and every weight element is broadcast once against all rows: NT weight rows x MV vectors of 16
// rows of accumulators, per k NT broadcasts and MV loads for NT * MV FMAs, no horizontal sums; the result
// tile is scattered to y once at the end.
//
// The weight is read through its row stride, so a row slice of a larger array (the fused q/k/v or
// gate/up weights, all weights packed into one huge-page arena) runs without a copy.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>
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

// y[MT, NT] (row stride ldy) = x[MT, K] (row stride ldx) . w[NT, K] (row stride ldw), K a multiple of 16.
template <int MT, int NT>
inline void tile(const float* x, size_t ldx, const float* w, size_t ldw, float* y, size_t ldy, int K) {
  vf acc[MT * NT];
  for (int i = 0; i < MT * NT; ++i) acc[i] = vf{};
  if constexpr (MT == 1) {
    for (int j = 0; j < NT; ++j) {
      const float* wj = w + j * ldw;
      vf a0 = vf{}, a1 = vf{};
      int k = 0;
      for (; k + 2 * W <= K; k += 2 * W) {
        a0 += vload(x + k) * vload(wj + k);
        a1 += vload(x + k + W) * vload(wj + k + W);
      }
      for (; k < K; k += W) a0 += vload(x + k) * vload(wj + k);
      acc[j] = a0 + a1;
    }
  } else if constexpr (NREG < 32) {
    // 16 registers (AVX2): one weight row at a time against all MT x rows (MT accumulators, x from L1),
    // so the weights stay one sequential stream as with one row; NT weight rows interleaved measured 2-4x
    // under the bandwidth here (4.3-8.6 GB/s at 2-8 rows against 18.9 at one).
    for (int j = 0; j < NT; ++j) {
      const float* wj = w + j * ldw;
      vf a[MT];
      for (int i = 0; i < MT; ++i) a[i] = vf{};
      for (int k = 0; k < K; k += W) {
        const vf wv = vload(wj + k);
        for (int i = 0; i < MT; ++i) a[i] += vload(x + i * ldx + k) * wv;
      }
      for (int i = 0; i < MT; ++i) acc[i * NT + j] = a[i];
    }
  } else {
    for (int k = 0; k < K; k += W) {
      vf wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = vload(w + j * ldw + k);
      for (int i = 0; i < MT; ++i) {
        const vf xv = vload(x + i * ldx + k);
        for (int j = 0; j < NT; ++j) acc[i * NT + j] += xv * wv[j];
      }
    }
  }
  if constexpr (MT * NT % W == 0) {
    for (int g = 0; g < MT * NT; g += W) {
      const vf sums = vsum_lanes(acc + g);
      for (int e = g; e < g + W; ++e) y[(e / NT) * ldy + e % NT] = sums[e - g];
    }
  } else {
    for (int i = 0; i < MT; ++i) {
      for (int j = 0; j < NT; ++j) y[i * ldy + j] = vsum(acc[i * NT + j]);
    }
  }
}

// Register tiles per ISA (simd.h): MT x NT accumulators + NT weight vectors + one x vector must fit the
// vector registers, or the compiler spills accumulators to the stack inside the K loop (measured on AVX2
// with AVX-512's tiles: 4x slower than OpenBLAS). 32 registers (AVX-512, NEON): 8x3, 4x4, 2x8, 1x16; 16
// (AVX2): 8x1, 4x2, 2x4, 1x8, each weight row streamed alone (see tile). The broadcast tiles past 8 rows: NT weight rows x 2 vectors of rows (plus 2 x
// vectors and the broadcast), or NT x 1 for a last block of up to W rows.
constexpr bool WIDE = NREG >= 32;
constexpr int NT8 = WIDE ? 3 : 1, NT4 = WIDE ? 4 : 2, NT2 = WIDE ? 8 : 4, NT1 = WIDE ? 16 : 8;
constexpr int BNT2 = WIDE ? 12 : 6, BNT1 = WIDE ? 16 : 12;

struct Args {
  const float* x;
  size_t ldx;
  const float* w;
  size_t ldw;
  float* y;
  int M, N, K;
};

// x rows [m0, m0 + MT) against weight rows [n0, n1), NT at a time (then one at a time).
template <int MT, int NT>
inline void rows_block(const Args& a, int m0, int n0, int n1) {
  const float* x = a.x + m0 * a.ldx;
  float* y = a.y + static_cast<size_t>(m0) * a.N;
  int n = n0;
  for (; n + NT <= n1; n += NT) tile<MT, NT>(x, a.ldx, a.w + n * a.ldw, a.ldw, y + n, a.N, a.K);
  for (; n < n1; ++n) tile<MT, 1>(x, a.ldx, a.w + n * a.ldw, a.ldw, y + n, a.N, a.K);
}

// Weight rows [n0, n1) (one band, L2-sized) for every x row: blocks of 8 x rows (AVX-512: 24 accumulators,
// 11 loads per 24 FMAs; AVX2: 8 accumulators, one weight row at a time), then 4, 2 and 1 for the remainder.
void band(const Args& a, int n0, int n1) {
  int m = 0;
  for (; m + 8 <= a.M; m += 8) rows_block<8, NT8>(a, m, n0, n1);
  for (; m + 4 <= a.M; m += 4) rows_block<4, NT4>(a, m, n0, n1);
  for (; m + 2 <= a.M; m += 2) rows_block<2, NT2>(a, m, n0, n1);
  for (; m < a.M; ++m) rows_block<1, NT1>(a, m, n0, n1);
}

// y[0:M, 0:NT] (row stride ldy) for weight rows w[0:NT] against xt[K][MV * 16] (rows past M are zeros).
template <int NT, int MV>
inline void btile(const float* xt, const float* w, size_t ldw, float* y, size_t ldy, int M, int K) {
  constexpr int MP = MV * W;
  vf acc[NT * MV];
  for (int i = 0; i < NT * MV; ++i) acc[i] = vf{};
  for (int k = 0; k < K; ++k) {
    vf xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = vload(xt + static_cast<size_t>(k) * MP + v * W);
    for (int j = 0; j < NT; ++j) {
      const vf b = vsplat(w[j * ldw + k]);
      for (int v = 0; v < MV; ++v) acc[j * MV + v] += b * xv[v];
    }
  }
  for (int j = 0; j < NT; ++j) {
    for (int v = 0; v < MV; ++v) {
      const vf r = acc[j * MV + v];
      const int m0 = v * W, m1 = std::min(M, m0 + W);
      for (int m = m0; m < m1; ++m) y[m * ldy + j] = r[m - m0];
    }
  }
}

// Weight rows [n0, n1) for rows m0.. of x (MV * 16 of them in xt), NT at a time, then one at a time.
template <int NT, int MV>
inline void bband(const Args& a, const float* xt, int m0, int n0, int n1) {
  const int rows = std::min(a.M - m0, MV * W);
  float* y = a.y + static_cast<size_t>(m0) * a.N;
  int n = n0;
  for (; n + NT <= n1; n += NT) btile<NT, MV>(xt, a.w + n * a.ldw, a.ldw, y + n, a.N, rows, a.K);
  for (; n < n1; ++n) btile<1, MV>(xt, a.w + n * a.ldw, a.ldw, y + n, a.N, rows, a.K);
}

// x rows [m0, m0 + MV * 16) transposed into xt[K][MV * 16], zero past M.
void transpose_rows(const Args& a, int m0, int mv, float* xt) {
  const int mp = mv * W, rows = std::min(a.M - m0, mp);
  std::memset(xt, 0, sizeof(float) * static_cast<size_t>(a.K) * mp);
  for (int m = 0; m < rows; ++m) {
    const float* xr = a.x + (m0 + m) * a.ldx;
    for (int k = 0; k < a.K; ++k) xt[static_cast<size_t>(k) * mp + m] = xr[k];
  }
}

void linear_impl(const Args& a) {
  auto& pool = ThreadPool::get();
  if (a.M > 8) {
    // Blocks of 2W rows (W for a last block of <= W): per weight band, every block reuses the band from
    // L2. Accumulators (AVX-512): 12 weight rows x 2 vectors, or 16 x 1 (24 x 1 measured 0.5-0.8x BLAS at
    // K = 1536: 24 weight rows read at once is more streams than the prefetchers follow); AVX2 6 x 2, 12 x 1.
    std::vector<float> xt;
    std::vector<std::pair<int, int>> blocks;  // (m0, vectors)
    for (int m0 = 0; m0 < a.M; m0 += 2 * W) blocks.emplace_back(m0, a.M - m0 > W ? 2 : 1);
    xt.resize(static_cast<size_t>(a.K) * 2 * W * blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) {
      transpose_rows(a, blocks[i].first, blocks[i].second, xt.data() + i * static_cast<size_t>(a.K) * 2 * W);
    }
    int rows = std::max(48, (a.N / (8 * pool.size())) / 48 * 48);
    if (blocks.size() > 1) rows = std::min(rows, std::max(48, (96 * 1024 / (a.K * 4)) / 48 * 48));
    const int bands = (a.N + rows - 1) / rows;
    pool.parallel_for(bands, [&](int b) {
      const int n0 = b * rows, n1 = std::min(a.N, n0 + rows);
      for (size_t i = 0; i < blocks.size(); ++i) {
        const float* xb = xt.data() + i * static_cast<size_t>(a.K) * 2 * W;
        if (blocks[i].second == 2) {
          bband<BNT2, 2>(a, xb, blocks[i].first, n0, n1);
        } else {
          bband<BNT1, 1>(a, xb, blocks[i].first, n0, n1);
        }
      }
    });
    return;
  }
  // Bands of whole 48-row tiles (divisible by every tile's NT: 3, 4, 6, 8, 12, 16), at least ~8 per thread so the
  // dynamic split stays even when another process holds a core, and at most ~96 KB of weights each.
  const int max_rows = std::max(48, (96 * 1024 / (a.K * 4)) / 48 * 48);
  int rows = std::max(48, (a.N / (8 * pool.size())) / 48 * 48);
  rows = std::min(rows, max_rows);
  const int bands = (a.N + rows - 1) / rows;
  pool.parallel_for(bands, [&](int b) {
    const int n0 = b * rows;
    band(a, n0, std::min(a.N, n0 + rows));
  });
}

#ifndef TRILLM_KERNEL_BODIES_ONLY
bool row_strided(const mx::array& w) {
  return w.ndim() == 2 && (w.strides()[1] == 1 || w.shape(1) == 1) && w.strides()[0] >= w.shape(1);
}

#endif

}  // namespace

#ifndef TRILLM_KERNEL_BODIES_ONLY
mx::array linear(const mx::array& x, const mx::array& weight, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32) {
    throw std::invalid_argument("[trillm linear] float32 only");
  }
  if (x.ndim() < 1 || weight.ndim() != 2 || weight.shape(1) != x.shape(-1) || x.shape(-1) % W != 0) {
    throw std::invalid_argument("[trillm linear] x [..., K] and weight [N, K] with K a multiple of 16 expected");
  }
  auto stream = mx::to_stream(s);
  auto shape = x.shape();
  shape.back() = weight.shape(0);
  // No contiguous() on the weight: eval_cpu reads it through its row stride (see the top of the file).
  return mx::array(shape, mx::float32, std::make_shared<Linear>(stream), {mx::contiguous(x, false, stream), weight});
}

void Linear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int K = w.shape(1), N = w.shape(0);
  const int M = static_cast<int>(x.size() / K);
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_output_array(out);
  if (row_strided(w)) {
    Args a{x.data<float>(), static_cast<size_t>(K), w.data<float>(), static_cast<size_t>(w.strides()[0]),
           out.data<float>(), M, N, K};
    enc.dispatch([a] { linear_impl(a); });
    return;
  }
  // Any other layout (a transposed view): copy it row-major once, inside the task.
  enc.dispatch([w, xp = x.data<float>(), yp = out.data<float>(), M, N, K] {
    std::vector<float> dense(static_cast<size_t>(N) * K);
    const float* src = w.data<float>();
    const auto s0 = w.strides()[0], s1 = w.strides()[1];
    for (int n = 0; n < N; ++n) {
      for (int k = 0; k < K; ++k) dense[static_cast<size_t>(n) * K + k] = src[n * s0 + k * s1];
    }
    linear_impl(Args{xp, static_cast<size_t>(K), dense.data(), static_cast<size_t>(K), yp, M, N, K});
  });
}

void Linear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm linear] the CPU primitive has no GPU implementation");
}

#endif  // TRILLM_KERNEL_BODIES_ONLY

}  // namespace trillm_cpu
