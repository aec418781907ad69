// silu(gate) * up as an MLX CPU primitive: one vectorised pass (exp from simd.h), split across cores.
// MLX's CPU backend evaluates the same expression with a scalar exp on one thread.
#include <cmath>
#include <stdexcept>

#ifndef TRILLM_KERNEL_BODIES_ONLY  // tests/kernels/cpu_bodies.cpp compiles the kernel bodies alone, without mlx
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#endif
#include "ops.h"
#include "simd.h"

namespace trillm_cpu {

namespace {

template <typename T>
void silu_mul_impl(const T* g, const T* u, T* out, size_t n) {
  parallel_chunks(n, 32768, [=](size_t i0, size_t i1) {
    size_t i = i0;
    if constexpr (std::is_same_v<T, float>) {
      for (; i + W <= i1; i += W) {
        const vf x = vload(g + i);
        vstore(out + i, x / (1.0f + vexp(-x)) * vload(u + i));
      }
    }
    for (; i < i1; ++i) {
      const float x = static_cast<float>(g[i]);
      out[i] = static_cast<T>(x / (1.0f + std::exp(-x)) * static_cast<float>(u[i]));
    }
  });
}

}  // namespace

#ifndef TRILLM_KERNEL_BODIES_ONLY
mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  if (gate.shape() != up.shape() || gate.dtype() != up.dtype()) {
    throw std::invalid_argument("[trillm silu_mul] gate and up must share shape and dtype");
  }
  if (gate.dtype() != mx::float32 && gate.dtype() != mx::float16 && gate.dtype() != mx::bfloat16) {
    throw std::invalid_argument("[trillm silu_mul] dtype must be float32, float16 or bfloat16");
  }
  auto stream = mx::to_stream(s);
  return mx::array(gate.shape(), gate.dtype(), std::make_shared<SiluMul>(stream),
                   {mx::contiguous(gate, false, stream), mx::contiguous(up, false, stream)});
}

void SiluMul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& g = inputs[0];
  const auto& u = inputs[1];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(g);
  enc.set_input_array(u);
  enc.set_output_array(out);
  const size_t n = out.size();
  if (g.dtype() == mx::float32) {
    enc.dispatch([gp = g.data<float>(), up = u.data<float>(), op = out.data<float>(), n] {
      silu_mul_impl(gp, up, op, n);
    });
  } else if (g.dtype() == mx::float16) {
    enc.dispatch([gp = g.data<mx::float16_t>(), up = u.data<mx::float16_t>(), op = out.data<mx::float16_t>(), n] {
      silu_mul_impl(gp, up, op, n);
    });
  } else {
    enc.dispatch([gp = g.data<mx::bfloat16_t>(), up = u.data<mx::bfloat16_t>(), op = out.data<mx::bfloat16_t>(),
                  n] { silu_mul_impl(gp, up, op, n); });
  }
}

void SiluMul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm silu_mul] the CPU primitive has no GPU implementation");
}

#endif  // TRILLM_KERNEL_BODIES_ONLY

}  // namespace trillm_cpu
