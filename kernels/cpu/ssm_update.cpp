// Mamba-2's state-space update for one token (decode), as mlx-lm's ssm_attn at seq_len 1 (the path its
// ssm_update takes off Metal): per (b, h) a state [Dh, Ds] (float32) and, with dA = exp(dt * A),
//
//     state = dA * state + (dt * x) B^T;   y = state . C + D * x
//
// where head h reads group h / (H / G) of B and C. MLX's ops path is a dozen small ops and full-state
// passes (repeat, transpose, matmuls); here each state row is read once, updated and dotted with C in
// registers, (b, h) items split across the cores.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#ifndef TRILLM_KERNEL_BODIES_ONLY
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#endif
#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

namespace trillm_cpu {

namespace {

struct SsmArgs {
  int B, H, G, Dh, Ds;
  const float* dt;  // fp32 [B, H], already softplus'd and clipped
  const float* A;  // fp32 [H] (-exp(A_log))
  const float* D;  // fp32 [H]
  const int* flags;  // [B] or null: bit 0 masked token, bit 1 state kept (lengths < 0)
  const float* state_in;  // fp32 [B, H, Dh, Ds]
  float* state_out;
};

// Rows [r0, r1) of item (b, h); Bf, Cf the item's group's B and C in fp32.
template <typename T>
void ssm_rows(const SsmArgs& a, int b, int h, int r0, int r1, const float* Bf, const float* Cf, const T* x, T* y) {
  const int Ds = a.Ds;
  const size_t bh = static_cast<size_t>(b) * a.H + h;
  const int fl = a.flags ? a.flags[b] : 0;
  const bool masked = fl & 1, keep = fl & 2;
  const float dt = a.dt[bh];
  // A masked token (mlx-lm's multiplicative mask): dtA = 0 and its contribution decays to 0, so the state
  // stays and y reads the old state.
  const float dA = masked ? 1.0f : std::exp(dt * a.A[h]);
  const float Dh_ = a.D[h];
  const vf vdA = vsplat(dA);
  const int nv = Ds / W * W;
  for (int r = r0; r < r1; ++r) {
    const size_t row = (bh * a.Dh + r) * Ds;
    const float* s = a.state_in + row;
    float* o = a.state_out + row;
    const float xr = static_cast<float>(x[bh * a.Dh + r]);
    const float dtx = masked ? 0.0f : dt * xr;
    const vf vdtx = vsplat(dtx);
    vf acc0 = vf{}, acc1 = vf{};
    int i = 0;
    for (; i + 2 * W <= nv; i += 2 * W) {
      const vf n0 = vdA * vload(s + i) + vdtx * vload(Bf + i);
      const vf n1 = vdA * vload(s + i + W) + vdtx * vload(Bf + i + W);
      acc0 += n0 * vload(Cf + i);
      acc1 += n1 * vload(Cf + i + W);
      if (!keep) {
        vstore(o + i, n0);
        vstore(o + i + W, n1);
      }
    }
    for (; i < nv; i += W) {
      const vf n0 = vdA * vload(s + i) + vdtx * vload(Bf + i);
      acc0 += n0 * vload(Cf + i);
      if (!keep) vstore(o + i, n0);
    }
    float acc = vsum(acc0 + acc1);
    for (; i < Ds; ++i) {
      const float n0 = dA * s[i] + dtx * Bf[i];
      acc += n0 * Cf[i];
      if (!keep) o[i] = n0;
    }
    if (keep) std::copy(s, s + Ds, o);
    y[bh * a.Dh + r] = static_cast<T>(acc + Dh_ * xr);
  }
}

template <typename T>
void ssm_update_run(const SsmArgs& a, const T* x, const T* Bm, const T* Cm, T* y) {
  const int rep = a.H / a.G;
  const int threads = ThreadPool::get().size();
  const int pairs = a.B * a.H;
  // Blocks of rows per (b, h): whole heads unless the pairs are too few to keep every thread busy.
  int rows = a.Dh;
  while (rows > 8 && static_cast<long>(pairs) * ((a.Dh + rows - 1) / rows) < 4L * threads) rows /= 2;
  const int blocks = (a.Dh + rows - 1) / rows;
  auto item = [&](int it) {
    const int blk = it % blocks;
    const int pair = it / blocks;
    const int b = pair / a.H, h = pair % a.H, g = h / rep;
    const size_t gb = (static_cast<size_t>(b) * a.G + g) * a.Ds;  // B, C: [B, G, Ds]
    thread_local std::vector<float> scratch;
    scratch.resize(2 * static_cast<size_t>(a.Ds));
    float* Bf = scratch.data();
    float* Cf = Bf + a.Ds;
    for (int i = 0; i < a.Ds; ++i) {
      Bf[i] = static_cast<float>(Bm[gb + i]);
      Cf[i] = static_cast<float>(Cm[gb + i]);
    }
    ssm_rows(a, b, h, blk * rows, std::min(a.Dh, (blk + 1) * rows), Bf, Cf, x, y);
  };
  const int n = pairs * blocks;
  if (n == 1) {
    item(0);
  } else {
    ThreadPool::get().parallel_for(n, item);
  }
}

}  // namespace

#ifndef TRILLM_KERNEL_BODIES_ONLY
std::vector<mx::array> ssm_update(const mx::array& x, const mx::array& A, const mx::array& B, const mx::array& C,
                                  const mx::array& D, const mx::array& dt, const mx::array& state,
                                  const std::optional<mx::array>& flags, mx::StreamOrDevice s) {
  if (x.ndim() != 4 || x.shape(1) != 1 || B.ndim() != 4 || C.shape() != B.shape() || B.shape(0) != x.shape(0) ||
      B.shape(1) != 1) {
    throw std::invalid_argument("[trillm ssm_update] x must be [B, 1, H, Dh] and B, C [B, 1, G, Ds]");
  }
  const int Bn = x.shape(0), H = x.shape(2), Dh = x.shape(3), G = B.shape(2), Ds = B.shape(3);
  if (G < 1 || H % G != 0) throw std::invalid_argument("[trillm ssm_update] heads must be a multiple of groups");
  if (x.dtype() != B.dtype() || x.dtype() != C.dtype() ||
      (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16)) {
    throw std::invalid_argument("[trillm ssm_update] x, B, C must share one of float32, float16, bfloat16");
  }
  if (A.size() != static_cast<size_t>(H) || D.size() != static_cast<size_t>(H) ||
      dt.size() != static_cast<size_t>(Bn) * H || state.shape() != mx::Shape{Bn, H, Dh, Ds}) {
    throw std::invalid_argument("[trillm ssm_update] A, D must be [H], dt [B, 1, H], state [B, H, Dh, Ds]");
  }
  if (flags && flags->size() != static_cast<size_t>(Bn)) {
    throw std::invalid_argument("[trillm ssm_update] flags must be [B]");
  }
  auto stream = mx::to_stream(s);
  auto f32 = [&](const mx::array& t) { return mx::contiguous(mx::astype(t, mx::float32, stream), false, stream); };
  std::vector<mx::array> inputs = {mx::contiguous(x, false, stream), mx::contiguous(B, false, stream),
                                   mx::contiguous(C, false, stream), f32(A), f32(D), f32(dt), f32(state)};
  if (flags) inputs.push_back(mx::contiguous(mx::astype(*flags, mx::int32, stream), false, stream));
  return mx::array::make_arrays({x.shape(), state.shape()}, {x.dtype(), mx::float32},
                                std::make_shared<SsmUpdate>(stream, flags.has_value()), inputs);
}

void SsmUpdate::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& Bm = inputs[1];
  const auto& Cm = inputs[2];
  auto& y = outputs[0];
  auto& st = outputs[1];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  st.set_data(mx::allocator::malloc(st.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(y);
  enc.set_output_array(st);
  SsmArgs a{x.shape(0), x.shape(2), Bm.shape(2), x.shape(3), Bm.shape(3), inputs[5].data<float>(),
            inputs[3].data<float>(), inputs[4].data<float>(), has_flags_ ? inputs[7].data<int>() : nullptr,
            inputs[6].data<float>(), st.data<float>()};
  if (x.dtype() == mx::float32) {
    enc.dispatch([a, xp = x.data<float>(), bp = Bm.data<float>(), cp = Cm.data<float>(), yp = y.data<float>()] {
      ssm_update_run(a, xp, bp, cp, yp);
    });
  } else if (x.dtype() == mx::float16) {
    enc.dispatch([a, xp = x.data<mx::float16_t>(), bp = Bm.data<mx::float16_t>(), cp = Cm.data<mx::float16_t>(),
                  yp = y.data<mx::float16_t>()] { ssm_update_run(a, xp, bp, cp, yp); });
  } else {
    enc.dispatch([a, xp = x.data<mx::bfloat16_t>(), bp = Bm.data<mx::bfloat16_t>(),
                  cp = Cm.data<mx::bfloat16_t>(), yp = y.data<mx::bfloat16_t>()] {
      ssm_update_run(a, xp, bp, cp, yp);
    });
  }
}

void SsmUpdate::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm ssm_update] the CPU primitive has no GPU implementation");
}

#endif  // TRILLM_KERNEL_BODIES_ONLY

}  // namespace trillm_cpu
