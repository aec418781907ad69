// RMSNorm as an MLX CPU primitive: one pass per row (sum of squares, then scale), rows split across cores.
// MLX's CPU backend runs mx.fast.rms_norm as five separate ops (square, mean, add, rsqrt, two multiplies).
#include <cmath>
#include <stdexcept>

#ifndef TRILLM_KERNEL_BODIES_ONLY  // tests/kernels/cpu_bodies.cpp compiles the kernel bodies alone, without mlx
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#endif
#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

namespace trillm_cpu {

void parallel_chunks(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  auto& pool = ThreadPool::get();
  const size_t chunks = std::min<size_t>(static_cast<size_t>(pool.size()) * 4, (n + grain - 1) / grain);
  if (chunks <= 1) {
    if (n) fn(0, n);
    return;
  }
  const size_t step = (n + chunks - 1) / chunks;
  pool.parallel_for(static_cast<int>(chunks), [&](int c) {
    const size_t begin = static_cast<size_t>(c) * step;
    if (begin < n) fn(begin, std::min(n, begin + step));
  });
}

namespace {

template <typename T>
void rms_rows(const T* x, const T* w, T* out, size_t rows, int D, float eps) {
  parallel_chunks(rows, std::max<size_t>(1, 16384 / D), [=](size_t r0, size_t r1) {
    for (size_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      T* orow = out + r * D;
      if constexpr (std::is_same_v<T, float>) {
        vf acc = vf{};
        int d = 0;
        for (; d + W <= D; d += W) {
          const vf v = vload(xr + d);
          acc += v * v;
        }
        float ss = vsum(acc);
        for (; d < D; ++d) ss += xr[d] * xr[d];
        const float inv = 1.0f / std::sqrt(ss / D + eps);
        d = 0;
        for (; d + W <= D; d += W) vstore(orow + d, (vload(xr + d) * inv) * vload(w + d));
        for (; d < D; ++d) orow[d] = (xr[d] * inv) * w[d];
      } else {
        float ss = 0.0f;
        for (int d = 0; d < D; ++d) {
          const float v = static_cast<float>(xr[d]);
          ss += v * v;
        }
        const float inv = 1.0f / std::sqrt(ss / D + eps);
        for (int d = 0; d < D; ++d) {
          orow[d] = static_cast<T>(static_cast<T>(static_cast<float>(xr[d]) * inv) * w[d]);
        }
      }
    }
  });
}

}  // namespace

#ifndef TRILLM_KERNEL_BODIES_ONLY
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("[trillm rms_norm] weight must be 1-D with x's last dimension");
  }
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    throw std::invalid_argument("[trillm rms_norm] dtype must be float32, float16 or bfloat16");
  }
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), x.dtype(), std::make_shared<RMSNorm>(stream, eps),
                   {mx::contiguous(x, false, stream),
                    mx::contiguous(mx::astype(weight, x.dtype(), stream), false, stream)});
}

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int D = x.shape(-1);
  const size_t rows = D ? x.size() / D : 0;
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_output_array(out);
  const float eps = eps_;
  if (x.dtype() == mx::float32) {
    enc.dispatch([xp = x.data<float>(), wp = w.data<float>(), op = out.data<float>(), rows, D, eps] {
      rms_rows(xp, wp, op, rows, D, eps);
    });
  } else if (x.dtype() == mx::float16) {
    enc.dispatch([xp = x.data<mx::float16_t>(), wp = w.data<mx::float16_t>(), op = out.data<mx::float16_t>(), rows,
                  D, eps] { rms_rows(xp, wp, op, rows, D, eps); });
  } else {
    enc.dispatch([xp = x.data<mx::bfloat16_t>(), wp = w.data<mx::bfloat16_t>(), op = out.data<mx::bfloat16_t>(),
                  rows, D, eps] { rms_rows(xp, wp, op, rows, D, eps); });
  }
}

void RMSNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm rms_norm] the CPU primitive has no GPU implementation");
}

#endif  // TRILLM_KERNEL_BODIES_ONLY

}  // namespace trillm_cpu
