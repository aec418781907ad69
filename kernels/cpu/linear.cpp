// Small-M matmul y = x @ w.T as an MLX CPU primitive, for decode (M = batch rows, 1 to ~32).
//
// MLX sends every matmul to cblas_sgemm; for a few rows OpenBLAS 0.3.21 reads the weights at ~7-12 GB/s,
// well under the memory bandwidth. Here each task streams a band of weight rows exactly once, and every x row
// reuses each weight vector from L1: tiles of MT x rows by NT weight rows hold MT * NT = 16 accumulators,
// reduced at the end by one transpose-add tree (simd.h). Bands of weight rows are split across the cores.
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"
#include "simd.h"

namespace trillm_cpu {

namespace {

// y[MT, NT] (row stride ldy) = x[MT, K] . w[NT, K] over K (a multiple of 16).
template <int MT, int NT>
inline void tile(const float* x, const float* w, float* y, int K, int ldy) {
  vf acc[MT * NT];
  for (int i = 0; i < MT * NT; ++i) acc[i] = vf{};
  if constexpr (MT == 1) {
    // One x row: walk the NT weight rows one after another, so the band is read front to back (one
    // sequential stream for the prefetchers instead of NT interleaved ones).
    for (int j = 0; j < NT; ++j) {
      const float* wj = w + static_cast<size_t>(j) * K;
      vf a0 = vf{}, a1 = vf{};
      int k = 0;
      for (; k + 2 * W <= K; k += 2 * W) {
        a0 += vload(x + k) * vload(wj + k);
        a1 += vload(x + k + W) * vload(wj + k + W);
      }
      for (; k < K; k += W) a0 += vload(x + k) * vload(wj + k);
      acc[j] = a0 + a1;
    }
  } else {
  for (int k = 0; k < K; k += W) {
    vf wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = vload(w + static_cast<size_t>(j) * K + k);
    for (int i = 0; i < MT; ++i) {
      const vf xv = vload(x + static_cast<size_t>(i) * K + k);
      for (int j = 0; j < NT; ++j) acc[i * NT + j] += xv * wv[j];
    }
  }
  }
  if constexpr (MT * NT == W) {
    const vf sums = vsum16(acc);
    for (int i = 0; i < MT; ++i) {
      for (int j = 0; j < NT; ++j) y[static_cast<size_t>(i) * ldy + j] = sums[i * NT + j];
    }
  } else {
    for (int i = 0; i < MT; ++i) {
      for (int j = 0; j < NT; ++j) y[static_cast<size_t>(i) * ldy + j] = vsum(acc[i * NT + j]);
    }
  }
}

// Weight rows [n0, n1) for every x row.
void band(const float* x, const float* w, float* y, int M, int N, int K, int n0, int n1) {
  int m = 0;
  // Blocks of 4 x rows: the 4 weight rows of a tile stay in L1 while every block passes over them.
  if (M >= 4) {
    for (int n = n0; n < n1; n += 4) {
      const float* wn = w + static_cast<size_t>(n) * K;
      if (n + 4 <= n1) {
        for (m = 0; m + 4 <= M; m += 4) tile<4, 4>(x + static_cast<size_t>(m) * K, wn, y + static_cast<size_t>(m) * N + n, K, N);
      } else {
        for (int j = n; j < n1; ++j) {
          for (m = 0; m + 4 <= M; m += 4) tile<4, 1>(x + static_cast<size_t>(m) * K, w + static_cast<size_t>(j) * K, y + static_cast<size_t>(m) * N + j, K, N);
        }
      }
    }
    m = M - M % 4;
  }
  for (; m < M; ++m) {  // single rows (M < 4, or the remainder): 16 weight rows per tile
    const float* xm = x + static_cast<size_t>(m) * K;
    float* ym = y + static_cast<size_t>(m) * N;
    int n = n0;
    for (; n + 16 <= n1; n += 16) tile<1, 16>(xm, w + static_cast<size_t>(n) * K, ym + n, K, N);
    for (; n < n1; ++n) tile<1, 1>(xm, w + static_cast<size_t>(n) * K, ym + n, K, N);
  }
}

void linear_impl(const float* x, const float* w, float* y, int M, int N, int K) {
  constexpr int ALIGN = 16;  // band edges on whole tiles
  const size_t bands = std::max<size_t>(1, (static_cast<size_t>(N) + 255) / 256);
  parallel_chunks(bands, 1, [=](size_t b0, size_t b1) {
    const int per = ((N + static_cast<int>(bands) - 1) / static_cast<int>(bands) + ALIGN - 1) / ALIGN * ALIGN;
    const int n0 = std::min(N, static_cast<int>(b0) * per), n1 = std::min(N, static_cast<int>(b1) * per);
    if (n0 < n1) band(x, w, y, M, N, K, n0, n1);
  });
}

}  // namespace

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
  return mx::array(shape, mx::float32, std::make_shared<Linear>(stream),
                   {mx::contiguous(x, false, stream), mx::contiguous(weight, false, stream)});
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
  enc.dispatch([xp = x.data<float>(), wp = w.data<float>(), yp = out.data<float>(), M, N, K] {
    linear_impl(xp, wp, yp, M, N, K);
  });
}

void Linear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm linear] the CPU primitive has no GPU implementation");
}

}  // namespace trillm_cpu
