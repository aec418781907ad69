// Mamba-2's state-space update over L tokens (decode: L = 1; prefill: L > 1), as mlx-lm's ssm_attn: per
// (b, h) a state [Dh, Ds] (float32) and, token by token, with dA = exp(dt * A),
//
//     state = dA * state + (dt * x) B^T;   y = state . C + D * x
//
// where head h reads group h / (H / G) of B and C. MLX's ops path is a dozen small ops and full-state passes
// per call (decode), or SSD's quadratic form over chunks of 256 tokens (prefill: an [L, L] decay matrix per
// head); here the scan walks the tokens in order, each item's state rows updated in place in L1 and dotted
// with C in registers, (b, h, row block) items split across the cores.
//
// mlx-lm's mask (multiplicative, [B, L]) and lengths ([B]), as its ssm_attn reads them: a masked token has no
// decay and no input (dtA * mask, segsum's mask), and its y is D * x plus only the decayed state the token's
// 256-token chunk started from (segsum's -inf zeroes the chunk's own inputs at a masked row); the returned
// state is the state after token lengths - 1 (clamped to [0, L - 1]), the incoming one for a negative length.
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

constexpr int kChunk = 256;  // mlx-lm's ssm_attn `step`: where a masked token's y restarts its decay

struct SsmArgs {
  int B, L, H, G, Dh, Ds;
  const float* dt;  // fp32 [B, L, H], already softplus'd and clipped
  const float* A;  // fp32 [H] (-exp(A_log))
  const float* D;  // fp32 [H]
  const float* state_in;  // fp32 [B, H, Dh, Ds], or null: zeros
  const int* mask;  // int32 [B, L] (0: masked), or null: every token
  const int* lengths;  // int32 [B], or null: L
  float* state_out;
};

// One state row's update for one token: dst = dA * src + dtx * Bf (dst may be src); returns dst . Cf.
inline float row_step(const float* src, float* dst, int Ds, float dA, float dtx, const float* Bf, const float* Cf) {
  const vf vdA = vsplat(dA), vdtx = vsplat(dtx);
  const int nv = Ds / W * W;
  vf acc0 = vf{}, acc1 = vf{};
  int i = 0;
  for (; i + 2 * W <= nv; i += 2 * W) {
    const vf n0 = vdA * vload(src + i) + vdtx * vload(Bf + i);
    const vf n1 = vdA * vload(src + i + W) + vdtx * vload(Bf + i + W);
    acc0 += n0 * vload(Cf + i);
    acc1 += n1 * vload(Cf + i + W);
    vstore(dst + i, n0);
    vstore(dst + i + W, n1);
  }
  for (; i < nv; i += W) {
    const vf n0 = vdA * vload(src + i) + vdtx * vload(Bf + i);
    acc0 += n0 * vload(Cf + i);
    vstore(dst + i, n0);
  }
  float acc = vsum(acc0 + acc1);
  for (; i < Ds; ++i) {
    const float n0 = dA * src[i] + dtx * Bf[i];
    acc += n0 * Cf[i];
    dst[i] = n0;
  }
  return acc;
}

inline float row_dot(const float* s, const float* Cf, int Ds) {
  const int nv = Ds / W * W;
  vf acc0 = vf{};
  int i = 0;
  for (; i < nv; i += W) acc0 += vload(s + i) * vload(Cf + i);
  float acc = vsum(acc0);
  for (; i < Ds; ++i) acc += s[i] * Cf[i];
  return acc;
}

// Scratch of one thread, reused across its items.
struct SsmScratch {
  std::vector<float> bc;  // B and C of the current token in fp32 [2, Ds]
  std::vector<float> zero;  // [Ds] zeros: the state without one
  std::vector<float> after;  // [rows, Ds] the running state past the returned token (lengths < L, negative)
  std::vector<float> start;  // [rows, Ds] the state a chunk with masked tokens started from
};

// Rows [r0, r1) of item (b, h), over the row's L tokens.
template <typename T>
void ssm_item(const SsmArgs& a, int b, int h, int r0, int r1, const T* x, const T* Bm, const T* Cm, T* y) {
  const int Ds = a.Ds, L = a.L, n = r1 - r0;
  const int g = h / (a.H / a.G);
  const size_t bh = static_cast<size_t>(b) * a.H + h;
  // Tokens 0 .. last write the returned state in place; past it the scan runs on in `after` for y alone.
  const int len = a.lengths ? a.lengths[b] : L;
  const int last = len < 0 ? -1 : std::clamp(len - 1, 0, L - 1);
  const int* mrow = a.mask ? a.mask + static_cast<size_t>(b) * L : nullptr;
  thread_local SsmScratch sc;
  sc.bc.resize(2 * static_cast<size_t>(Ds));
  sc.zero.assign(Ds, 0.0f);
  if (last < L - 1) sc.after.resize(static_cast<size_t>(n) * Ds);
  if (mrow) sc.start.resize(static_cast<size_t>(n) * Ds);
  float* Bf = sc.bc.data();
  float* Cf = Bf + Ds;
  auto out_row = [&](int r) { return a.state_out + (bh * a.Dh + r) * Ds; };
  auto in_row = [&](int r) { return a.state_in ? a.state_in + (bh * a.Dh + r) * Ds : sc.zero.data(); };
  // The state row entering token t (t > 0: where token t - 1 wrote it) and where token t writes it.
  auto dst_row = [&](int t, int r) { return t <= last ? out_row(r) : &sc.after[(r - r0) * Ds]; };
  auto src_row = [&](int t, int r) -> const float* { return t == 0 ? in_row(r) : dst_row(t - 1, r); };
  const float A = a.A[h], Dv = a.D[h];
  float cum = 0.0f;  // this chunk's summed dt * A over unmasked tokens so far (a masked token's decay)
  bool chunk_masked = false;
  for (int t = 0; t < L; ++t) {
    if (mrow && t % kChunk == 0) {
      cum = 0.0f;
      const int end = std::min(L, t + kChunk);
      chunk_masked = std::find(mrow + t, mrow + end, 0) != mrow + end;
      if (chunk_masked) {
        for (int r = r0; r < r1; ++r) std::copy_n(src_row(t, r), Ds, &sc.start[(r - r0) * Ds]);
      }
    }
    const size_t tok = static_cast<size_t>(b) * L + t;
    const size_t gb = (tok * a.G + g) * Ds;
    const size_t xo = (tok * a.H + h) * a.Dh;
    const bool masked = mrow && mrow[t] == 0;
    for (int i = 0; i < Ds; ++i) Cf[i] = static_cast<float>(Cm[gb + i]);
    if (masked) {
      // No decay, no input: the state stays (copied where token t writes it); y as ssm_attn's.
      const float p = std::exp(cum);
      for (int r = r0; r < r1; ++r) {
        const float* s = src_row(t, r);
        float* d = dst_row(t, r);
        if (d != s) std::copy_n(s, Ds, d);
        const float xr = static_cast<float>(x[xo + r]);
        y[xo + r] = static_cast<T>(p * row_dot(&sc.start[(r - r0) * Ds], Cf, Ds) + Dv * xr);
      }
      continue;
    }
    for (int i = 0; i < Ds; ++i) Bf[i] = static_cast<float>(Bm[gb + i]);
    const float dt = a.dt[tok * a.H + h];
    cum += dt * A;
    const float dA = std::exp(dt * A);
    for (int r = r0; r < r1; ++r) {
      const float xr = static_cast<float>(x[xo + r]);
      const float acc = row_step(src_row(t, r), dst_row(t, r), Ds, dA, dt * xr, Bf, Cf);
      y[xo + r] = static_cast<T>(acc + Dv * xr);
    }
  }
  if (last < 0) {
    for (int r = r0; r < r1; ++r) std::copy_n(in_row(r), Ds, out_row(r));
  }
}

template <typename T>
void ssm_update_run(const SsmArgs& a, const T* x, const T* Bm, const T* Cm, T* y) {
  const int threads = ThreadPool::get().size();
  const int pairs = a.B * a.H;
  // Blocks of rows per (b, h): whole heads unless the pairs are too few to keep every thread busy; over
  // several tokens at most 16 KiB of state per item, which stays in L1 from token to token.
  int rows = a.Dh;
  if (a.L > 1) {
    while (rows > 8 && rows * a.Ds > 4096) rows /= 2;
  }
  while (rows > 8 && static_cast<long>(pairs) * ((a.Dh + rows - 1) / rows) < 4L * threads) rows /= 2;
  const int blocks = (a.Dh + rows - 1) / rows;
  auto item = [&](int it) {
    const int blk = it % blocks;
    const int pair = it / blocks;
    ssm_item(a, pair / a.H, pair % a.H, blk * rows, std::min(a.Dh, (blk + 1) * rows), x, Bm, Cm, y);
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
                                  const mx::array& D, const mx::array& dt, const std::optional<mx::array>& state,
                                  const std::optional<mx::array>& mask, const std::optional<mx::array>& lengths,
                                  mx::StreamOrDevice s) {
  if (x.ndim() != 4 || B.ndim() != 4 || C.shape() != B.shape() || B.shape(0) != x.shape(0) ||
      B.shape(1) != x.shape(1) || x.shape(1) < 1) {
    throw std::invalid_argument("[trillm ssm_update] x must be [B, L, H, Dh] and B, C [B, L, G, Ds]");
  }
  const int Bn = x.shape(0), L = x.shape(1), H = x.shape(2), Dh = x.shape(3), G = B.shape(2), Ds = B.shape(3);
  if (G < 1 || H % G != 0) throw std::invalid_argument("[trillm ssm_update] heads must be a multiple of groups");
  if (x.dtype() != B.dtype() || x.dtype() != C.dtype() ||
      (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16)) {
    throw std::invalid_argument("[trillm ssm_update] x, B, C must share one of float32, float16, bfloat16");
  }
  const mx::Shape state_shape{Bn, H, Dh, Ds};
  if (A.size() != static_cast<size_t>(H) || D.size() != static_cast<size_t>(H) ||
      dt.size() != static_cast<size_t>(Bn) * L * H || (state && state->shape() != state_shape)) {
    throw std::invalid_argument("[trillm ssm_update] A, D must be [H], dt [B, L, H], state [B, H, Dh, Ds]");
  }
  if ((mask && mask->size() != static_cast<size_t>(Bn) * L) || (lengths && lengths->size() != static_cast<size_t>(Bn))) {
    throw std::invalid_argument("[trillm ssm_update] mask must be [B, L] and lengths [B]");
  }
  auto stream = mx::to_stream(s);
  auto as = [&](const mx::array& t, mx::Dtype d) { return mx::contiguous(mx::astype(t, d, stream), false, stream); };
  std::vector<mx::array> inputs = {mx::contiguous(x, false, stream), mx::contiguous(B, false, stream),
                                   mx::contiguous(C, false, stream), as(A, mx::float32), as(D, mx::float32),
                                   as(dt, mx::float32)};
  if (state) inputs.push_back(as(*state, mx::float32));
  if (mask) inputs.push_back(as(*mask, mx::int32));
  if (lengths) inputs.push_back(as(*lengths, mx::int32));
  return mx::array::make_arrays({x.shape(), state_shape}, {x.dtype(), mx::float32},
                                std::make_shared<SsmUpdate>(stream, state.has_value(), mask.has_value(),
                                                            lengths.has_value()),
                                inputs);
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
  size_t next = 6;
  const float* state_in = has_state_ ? inputs[next++].data<float>() : nullptr;
  const int* mask = has_mask_ ? inputs[next++].data<int>() : nullptr;
  const int* lengths = has_lengths_ ? inputs[next++].data<int>() : nullptr;
  SsmArgs a{x.shape(0), x.shape(1), x.shape(2), Bm.shape(2), x.shape(3), Bm.shape(3), inputs[5].data<float>(),
            inputs[3].data<float>(), inputs[4].data<float>(), state_in, mask, lengths, st.data<float>()};
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
