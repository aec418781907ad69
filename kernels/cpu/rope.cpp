// RoPE as an MLX CPU primitive: one op where MLX's CPU backend runs ~20 (positions, frequencies, cos, sin,
// slices, products, concatenations). Reads x through its strides, so the head-major transpose that
// precedes it in the attention block costs no extra copy; cos/sin are computed once per position and shared
// by every head.
#include <cmath>
#include <stdexcept>
#include <vector>

#ifndef TRILLM_KERNEL_BODIES_ONLY  // tests/kernels/cpu_bodies.cpp compiles the kernel bodies alone, without mlx
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#endif
#include "ops.h"
#include "thread_pool.h"

namespace trillm_cpu {

namespace {

struct RopeArgs {
  int B, H, L, D, dims;
  int64_t s0, s1, s2, s3;  // x's strides (elements) as [B, H, L, D]
  bool traditional;
  float base, scale;
  int num_offsets;  // 1 or B
};

template <typename T>
void rope_impl(const RopeArgs& a, const T* x, const int32_t* offsets, T* out) {
  const int half = a.dims / 2;
  std::vector<float> inv_freq(half);
  const float step = std::log(a.base) / half;  // as MLX: exp(-i * log(base) / half)
  for (int i = 0; i < half; ++i) inv_freq[i] = std::exp(static_cast<float>(-i) * step);
  const size_t positions = static_cast<size_t>(a.B) * a.L;
  parallel_chunks(positions, std::max<size_t>(1, 8192 / (static_cast<size_t>(a.H) * a.D)), [&](size_t p0, size_t p1) {
    std::vector<float> cs(2 * half);
    for (size_t p = p0; p < p1; ++p) {
      const int b = static_cast<int>(p / a.L), l = static_cast<int>(p % a.L);
      const float pos = static_cast<float>(offsets[a.num_offsets == 1 ? 0 : b] + l) * a.scale;
      for (int i = 0; i < half; ++i) {
        const float theta = pos * inv_freq[i];
        cs[i] = std::cos(theta);
        cs[half + i] = std::sin(theta);
      }
      for (int h = 0; h < a.H; ++h) {
        const T* xr = x + b * a.s0 + h * a.s1 + l * a.s2;
        T* orow = out + ((static_cast<size_t>(b) * a.H + h) * a.L + l) * a.D;
        for (int i = 0; i < half; ++i) {
          const int i1 = a.traditional ? 2 * i : i;
          const int i2 = a.traditional ? 2 * i + 1 : i + half;
          const float x1 = static_cast<float>(xr[i1 * a.s3]), x2 = static_cast<float>(xr[i2 * a.s3]);
          const float c = cs[i], s = cs[half + i];
          orow[i1] = static_cast<T>(x1 * c - x2 * s);
          orow[i2] = static_cast<T>(x1 * s + x2 * c);
        }
        for (int d = a.dims; d < a.D; ++d) orow[d] = xr[d * a.s3];
      }
    }
  });
}

}  // namespace

#ifndef TRILLM_KERNEL_BODIES_ONLY
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, const mx::array& offset,
               mx::StreamOrDevice s) {
  if (x.ndim() != 3 && x.ndim() != 4) throw std::invalid_argument("[trillm rope] x must be 3-D or 4-D");
  if (dims < 2 || dims % 2 || dims > x.shape(-1)) {
    throw std::invalid_argument("[trillm rope] dims must be even and at most the last dimension");
  }
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    throw std::invalid_argument("[trillm rope] dtype must be float32, float16 or bfloat16");
  }
  if (offset.size() != 1 && !(offset.ndim() == 1 && offset.shape(0) == x.shape(0))) {
    throw std::invalid_argument("[trillm rope] offset must be a scalar or one per batch row");
  }
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), x.dtype(), std::make_shared<RoPE>(stream, dims, traditional, base, scale),
                   {x, mx::contiguous(mx::astype(mx::reshape(offset, {-1}, stream), mx::int32, stream), false,
                                      stream)});
}

void RoPE::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& off = inputs[1];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  RopeArgs a{};
  const auto& st = x.strides();
  if (x.ndim() == 4) {
    a = {x.shape(0), x.shape(1), x.shape(2), x.shape(3), dims_, st[0], st[1], st[2], st[3]};
  } else {  // [B, L, D]: one head
    a = {x.shape(0), 1, x.shape(1), x.shape(2), dims_, st[0], 0, st[1], st[2]};
  }
  a.traditional = traditional_;
  a.base = base_;
  a.scale = scale_;
  a.num_offsets = static_cast<int>(off.size());
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(off);
  enc.set_output_array(out);
  if (x.dtype() == mx::float32) {
    enc.dispatch([a, xp = x.data<float>(), o = off.data<int32_t>(), op = out.data<float>()] {
      rope_impl(a, xp, o, op);
    });
  } else if (x.dtype() == mx::float16) {
    enc.dispatch([a, xp = x.data<mx::float16_t>(), o = off.data<int32_t>(), op = out.data<mx::float16_t>()] {
      rope_impl(a, xp, o, op);
    });
  } else {
    enc.dispatch([a, xp = x.data<mx::bfloat16_t>(), o = off.data<int32_t>(), op = out.data<mx::bfloat16_t>()] {
      rope_impl(a, xp, o, op);
    });
  }
}

void RoPE::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm rope] the CPU primitive has no GPU implementation");
}

#endif  // TRILLM_KERNEL_BODIES_ONLY

}  // namespace trillm_cpu
