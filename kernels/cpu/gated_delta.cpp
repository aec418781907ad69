// The gated delta rule (the linear attention of Qwen3-Next / Qwen3.5) as an MLX CPU primitive: the recurrent
// step for decode (T == 1) and the sequential scan over T tokens for prefill, as mlx-lm's gated_delta_ops.
//
// Each value row of the state (state[b, hv, dv, :], Dk floats) evolves on its own: its decay, its k.state
// read-out, its update and its q read-out involve no other row. So one work item is a block of rows of one
// (b, hv), each row held in registers over all T tokens (q and k of the item's key head, converted to fp32
// once per item), instead of MLX's ops path: seven full-state ops per token, on one thread, for each token.
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

struct GdnArgs {
  int B, T, Hk, Hv, Dk, Dv;
  bool vec_g;  // g [B, T, Hv, Dk] (else [B, T, Hv])
  const float* g;  // fp32
  const float* beta;  // fp32 [B, T, Hv]
  const bool* mask;  // [B, T] or null
  const float* state_in;  // fp32 [B, Hv, Dv, Dk]
  float* state_out;
};

// Rows [r0, r1) of item (b, hv): q, k point at token 0 of the item's key head, qk_stride floats between tokens.
template <typename T, int NV, int R>
void rows_vec(const GdnArgs& a, int b, int hv, int r0, int r1, const float* q, const float* k, size_t qk_stride,
              const T* v, T* y) {
  const int Dk = a.Dk, Dv = a.Dv, Hv = a.Hv, Tn = a.T;
  const size_t vy_stride = static_cast<size_t>(Hv) * Dv;  // v, y: [B, T, Hv, Dv]
  const size_t bt0 = static_cast<size_t>(b) * Tn;
  for (int r = r0; r < r1; r += R) {
    const int nr = std::min(R, r1 - r);
    vf s[R][NV];
    for (int j = 0; j < R; ++j) {
      const float* src = a.state_in + ((static_cast<size_t>(b) * Hv + hv) * Dv + r + (j < nr ? j : 0)) * Dk;
      for (int i = 0; i < NV; ++i) s[j][i] = vload(src + i * W);
    }
    for (int t = 0; t < Tn; ++t) {
      const float* kt = k + t * qk_stride;
      const float* qt = q + t * qk_stride;
      const size_t sh = (bt0 + t) * Hv + hv;  // g, beta: [B, T, Hv]
      const float beta = a.beta[sh];
      const bool keep = a.mask == nullptr || a.mask[bt0 + t];
      vf dec[NV];
      if (a.vec_g) {
        for (int i = 0; i < NV; ++i) dec[i] = vload(a.g + sh * Dk + i * W);
      } else {
        for (int i = 0; i < NV; ++i) dec[i] = vsplat(a.g[sh]);
      }
      float kv[R];
      for (int j = 0; j < R; ++j) {
        vf acc0 = vf{}, acc1 = vf{};
        for (int i = 0; i < NV; i += 2) {
          acc0 += (s[j][i] * dec[i]) * vload(kt + i * W);
          if (i + 1 < NV) acc1 += (s[j][i + 1] * dec[i + 1]) * vload(kt + (i + 1) * W);
        }
        kv[j] = vsum(acc0 + acc1);
      }
      for (int j = 0; j < R; ++j) {
        if (j >= nr) break;
        const size_t vy = (bt0 + t) * vy_stride + static_cast<size_t>(hv) * Dv + r + j;
        const float delta = (static_cast<float>(v[vy]) - kv[j]) * beta;
        const vf dv = vsplat(delta);
        vf acc0 = vf{}, acc1 = vf{};
        for (int i = 0; i < NV; ++i) {
          const vf ns = s[j][i] * dec[i] + vload(kt + i * W) * dv;
          if (i % 2 == 0) acc0 += ns * vload(qt + i * W);
          else acc1 += ns * vload(qt + i * W);
          // A masked token (padding) leaves the state as it was; its output is computed all the same (ops').
          if (keep) s[j][i] = ns;
        }
        y[vy] = static_cast<T>(vsum(acc0 + acc1));
      }
    }
    for (int j = 0; j < nr; ++j) {
      float* dst = a.state_out + ((static_cast<size_t>(b) * Hv + hv) * Dv + r + j) * Dk;
      for (int i = 0; i < NV; ++i) vstore(dst + i * W, s[j][i]);
    }
  }
}

// Any Dk: the same recurrence, one row at a time through a scratch row.
template <typename T>
void rows_scalar(const GdnArgs& a, int b, int hv, int r0, int r1, const float* q, const float* k, size_t qk_stride,
                 const T* v, T* y) {
  const int Dk = a.Dk, Dv = a.Dv, Hv = a.Hv, Tn = a.T;
  const size_t vy_stride = static_cast<size_t>(Hv) * Dv;
  const size_t bt0 = static_cast<size_t>(b) * Tn;
  std::vector<float> s(Dk), ns(Dk);
  for (int r = r0; r < r1; ++r) {
    const size_t row = ((static_cast<size_t>(b) * Hv + hv) * Dv + r) * Dk;
    std::copy(a.state_in + row, a.state_in + row + Dk, s.begin());
    for (int t = 0; t < Tn; ++t) {
      const float* kt = k + t * qk_stride;
      const float* qt = q + t * qk_stride;
      const size_t sh = (bt0 + t) * Hv + hv;
      float kv = 0.0f;
      for (int i = 0; i < Dk; ++i) {
        ns[i] = s[i] * (a.vec_g ? a.g[sh * Dk + i] : a.g[sh]);
        kv += ns[i] * kt[i];
      }
      const size_t vy = (bt0 + t) * vy_stride + static_cast<size_t>(hv) * Dv + r;
      const float delta = (static_cast<float>(v[vy]) - kv) * a.beta[sh];
      float out = 0.0f;
      for (int i = 0; i < Dk; ++i) {
        ns[i] += kt[i] * delta;
        out += ns[i] * qt[i];
      }
      y[vy] = static_cast<T>(out);
      if (a.mask == nullptr || a.mask[bt0 + t]) s.swap(ns);
    }
    std::copy(s.begin(), s.end(), a.state_out + row);
  }
}

template <typename T>
using RowsFn = void (*)(const GdnArgs&, int, int, int, int, const float*, const float*, size_t, const T*, T*);

template <typename T, int NV>
constexpr RowsFn<T> vec_rows() {
  // Two rows at once where their state fits the register file twice over (AVX-512 at Dk 128): the second
  // row's reductions overlap the first's.
  constexpr int R = (2 * 2 * NV <= NREG) ? 2 : 1;
  return &rows_vec<T, NV, R>;
}

template <typename T>
RowsFn<T> pick_rows(int Dk) {
  if (Dk % W == 0) {
    switch (Dk / W) {
      case 2: return vec_rows<T, 2>();
      case 4: return vec_rows<T, 4>();
      case 8: return vec_rows<T, 8>();
      case 16: return vec_rows<T, 16>();
      case 32: return vec_rows<T, 32>();
      default: break;
    }
  }
  return &rows_scalar<T>;
}

template <typename T>
void gated_delta_run(const GdnArgs& a, const T* q, const T* k, const T* v, T* y) {
  const int rep = a.Hv / a.Hk;
  // Items: (b, hv, block of rows). Blocks of up to 32 rows, smaller when (b, hv) pairs are too few to keep
  // every thread busy (decode at batch 1).
  const int threads = ThreadPool::get().size();
  const int pairs = a.B * a.Hv;
  int rows = std::min(a.Dv, 32);
  while (rows > 4 && static_cast<long>(pairs) * ((a.Dv + rows - 1) / rows) < 4L * threads) rows /= 2;
  const int blocks = (a.Dv + rows - 1) / rows;
  const RowsFn<T> fn = pick_rows<T>(a.Dk);
  const size_t qk_tok = static_cast<size_t>(a.Hk) * a.Dk;  // q, k: [B, T, Hk, Dk]
  auto item = [&](int it) {
    const int blk = it % blocks;
    const int pair = it / blocks;
    const int b = pair / a.Hv, hv = pair % a.Hv, hk = hv / rep;
    const int r0 = blk * rows, r1 = std::min(a.Dv, r0 + rows);
    const size_t base = static_cast<size_t>(b) * a.T * qk_tok + static_cast<size_t>(hk) * a.Dk;
    if constexpr (std::is_same_v<T, float>) {
      fn(a, b, hv, r0, r1, q + base, k + base, qk_tok, v, y);
    } else {
      // q and k of this key head, all T tokens, in fp32 once per item (the rows read them T times each).
      thread_local std::vector<float> scratch;
      const size_t n = static_cast<size_t>(a.T) * a.Dk;
      scratch.resize(2 * n);
      float* qf = scratch.data();
      float* kf = qf + n;
      for (int t = 0; t < a.T; ++t) {
        const T* qs = q + base + t * qk_tok;
        const T* ks = k + base + t * qk_tok;
        for (int i = 0; i < a.Dk; ++i) {
          qf[static_cast<size_t>(t) * a.Dk + i] = static_cast<float>(qs[i]);
          kf[static_cast<size_t>(t) * a.Dk + i] = static_cast<float>(ks[i]);
        }
      }
      fn(a, b, hv, r0, r1, qf, kf, a.Dk, v, y);
    }
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
std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                                   const mx::array& beta, const mx::array& state,
                                   const std::optional<mx::array>& mask, mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.shape() != q.shape() || v.ndim() != 4 || v.shape(0) != q.shape(0) ||
      v.shape(1) != q.shape(1)) {
    throw std::invalid_argument("[trillm gated_delta] q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv]");
  }
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3), Hv = v.shape(2), Dv = v.shape(3);
  if (Hk < 1 || Hv % Hk != 0) {
    throw std::invalid_argument("[trillm gated_delta] value heads must be a multiple of key heads");
  }
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype() ||
      (q.dtype() != mx::float32 && q.dtype() != mx::float16 && q.dtype() != mx::bfloat16)) {
    throw std::invalid_argument("[trillm gated_delta] q, k, v must share one of float32, float16, bfloat16");
  }
  const bool vec_g = g.ndim() == 4;
  if (!(g.ndim() == 3 && g.shape() == mx::Shape{B, T, Hv}) && !(vec_g && g.shape() == mx::Shape{B, T, Hv, Dk})) {
    throw std::invalid_argument("[trillm gated_delta] g must be [B, T, Hv] or [B, T, Hv, Dk]");
  }
  if (beta.shape() != mx::Shape{B, T, Hv} || state.shape() != mx::Shape{B, Hv, Dv, Dk}) {
    throw std::invalid_argument("[trillm gated_delta] beta must be [B, T, Hv] and state [B, Hv, Dv, Dk]");
  }
  if (mask && mask->shape() != mx::Shape{B, T}) {
    throw std::invalid_argument("[trillm gated_delta] mask must be [B, T]");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {
      mx::contiguous(q, false, stream), mx::contiguous(k, false, stream), mx::contiguous(v, false, stream),
      mx::contiguous(mx::astype(g, mx::float32, stream), false, stream),
      mx::contiguous(mx::astype(beta, mx::float32, stream), false, stream),
      mx::contiguous(mx::astype(state, mx::float32, stream), false, stream)};
  if (mask) inputs.push_back(mx::contiguous(mx::astype(*mask, mx::bool_, stream), false, stream));
  return mx::array::make_arrays({mx::Shape{B, T, Hv, Dv}, state.shape()}, {q.dtype(), mx::float32},
                                std::make_shared<GatedDelta>(stream, vec_g, mask.has_value()), inputs);
}

void GatedDelta::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  auto& y = outputs[0];
  auto& st = outputs[1];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  st.set_data(mx::allocator::malloc(st.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(y);
  enc.set_output_array(st);
  GdnArgs a{q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3), vec_g_,
            inputs[3].data<float>(), inputs[4].data<float>(), has_mask_ ? inputs[6].data<bool>() : nullptr,
            inputs[5].data<float>(), st.data<float>()};
  if (q.dtype() == mx::float32) {
    enc.dispatch([a, qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(), yp = y.data<float>()] {
      gated_delta_run(a, qp, kp, vp, yp);
    });
  } else if (q.dtype() == mx::float16) {
    enc.dispatch([a, qp = q.data<mx::float16_t>(), kp = k.data<mx::float16_t>(), vp = v.data<mx::float16_t>(),
                  yp = y.data<mx::float16_t>()] { gated_delta_run(a, qp, kp, vp, yp); });
  } else {
    enc.dispatch([a, qp = q.data<mx::bfloat16_t>(), kp = k.data<mx::bfloat16_t>(), vp = v.data<mx::bfloat16_t>(),
                  yp = y.data<mx::bfloat16_t>()] { gated_delta_run(a, qp, kp, vp, yp); });
  }
}

void GatedDelta::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm gated_delta] the CPU primitive has no GPU implementation");
}

#endif  // TRILLM_KERNEL_BODIES_ONLY

}  // namespace trillm_cpu
