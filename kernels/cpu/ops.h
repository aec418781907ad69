// trillm's CPU kernels as MLX primitives: each op builds one graph node whose eval_cpu runs the kernel.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// TRILLM_KERNEL_BODIES_ONLY: the plain declarations only, for tests/kernels/cpu_bodies.cpp (the kernel bodies without mlx).
#ifndef TRILLM_KERNEL_BODIES_ONLY
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
#endif

namespace trillm_cpu {

#ifndef TRILLM_KERNEL_BODIES_ONLY
// Paged attention over the KV pool (layout: trillm.kernels.layout), decode (L == 1) and prefill chunks
// (L > 1) with the cached prefix, reading K/V through the block tables. Shapes as paged_attention_ref:
// q [B, Hq, L, D]; k_pool, v_pool [num_blocks, bs, Hkv, D]; block_tables int32 [B, max_blocks];
// context_lens int32 [B]; sinks [Hq] or none; window 0 = none; softcap 0 = none (else scores =
// softcap * tanh(scores / softcap) after the scale, before the mask); chunk 0 = none (else chunked attention,
// Llama 4's: the query at pos sees keys >= pos - pos % chunk only) -> [B, Hq, L, D] in q's dtype.
// The pools: q's dtype, float16/bfloat16 under float32 q, int8 with k_scale and v_scale, float32
// [num_blocks, bs, Hkv] (one scale per token and KV head; value = q * scale), or int4: uint8
// [num_blocks, bs, Hkv, D / 2] (element 2i in byte i's low nibble) with float32 (scale, min) pools
// [num_blocks, bs, Hkv, G, 2] (per group of D / G values; value = q * scale + min).
mx::array paged_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                          const mx::array& block_tables, const mx::array& context_lens, float scale, int window,
                          const std::optional<mx::array>& sinks, float softcap = 0.0f, int chunk = 0,
                          const std::optional<mx::array>& k_scale = std::nullopt,
                          const std::optional<mx::array>& v_scale = std::nullopt, mx::StreamOrDevice s = {});

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, float scale, int window, bool has_sinks, float softcap, int chunk)
      : mx::Primitive(stream), scale_(scale), window_(window), has_sinks_(has_sinks), softcap_(softcap),
        chunk_(chunk) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmPagedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int window_;
  bool has_sinks_;
  float softcap_;
  int chunk_;
};

// Paged MLA attention (DeepSeek V2/V3's latent cache; trillm.kernels.mla_attention): q_latent [B, H, L, R]
// (q_nope through embed_q), q_pe [B, H, L, P]; latent_pool [num_blocks, bs, 1, R], pe_pool [num_blocks, bs, 1,
// P]; block_tables int32 [B, max_blocks]; context_lens int32 [B]. score = scale * (q_latent . latent + q_pe .
// k_pe), causal by position as paged_attention -> softmax . latent, [B, H, L, R] in q_latent's dtype.
// R and P multiples of 16.
mx::array mla_attention(const mx::array& q_latent, const mx::array& q_pe, const mx::array& latent_pool,
                        const mx::array& pe_pool, const mx::array& block_tables, const mx::array& context_lens,
                        float scale, mx::StreamOrDevice s = {});

#endif  // TRILLM_KERNEL_BODIES_ONLY

// How one MLA call splits its work: HPI heads x QT queries per item, the context in num_parts partitions of
// part_size tokens (a reduction merges them when num_parts > 1).
struct MlaPlan {
  int hpi, qt, num_qtiles, num_parts, part_size;
};
MlaPlan mla_plan(int batch, int num_heads, int num_queries, int max_tokens, int threads);

#ifndef TRILLM_KERNEL_BODIES_ONLY

class MlaAttention : public mx::Primitive {
 public:
  MlaAttention(mx::Stream stream, float scale) : mx::Primitive(stream), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmMlaAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
};

// The gated delta rule (Qwen3-Next / Qwen3.5 linear attention), as mlx-lm's gated_delta_ops: q, k
// [B, T, Hk, Dk], v [B, T, Hv, Dv] (one dtype of float32, float16, bfloat16; value head hv reads key head
// hv / (Hv / Hk)); g [B, T, Hv] or [B, T, Hv, Dk] and beta [B, T, Hv] (read as float32); state [B, Hv, Dv,
// Dk] (float32); mask bool [B, T] or none (a masked token leaves the state as it was). Per token:
// state *= g; delta = (v - state . k) * beta; state += k delta^T; y = state . q -> {y [B, T, Hv, Dv] in q's
// dtype, the new state float32}.
std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                                   const mx::array& beta, const mx::array& state,
                                   const std::optional<mx::array>& mask, mx::StreamOrDevice s = {});

class GatedDelta : public mx::Primitive {
 public:
  GatedDelta(mx::Stream stream, bool vec_g, bool has_mask)
      : mx::Primitive(stream), vec_g_(vec_g), has_mask_(has_mask) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmGatedDelta";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatedDelta&>(other);
    return vec_g_ == o.vec_g_ && has_mask_ == o.has_mask_;
  }

 private:
  bool vec_g_;
  bool has_mask_;
};

// Mamba-2's state-space update over L tokens, as mlx-lm's ssm_attn: x [B, L, H, Dh], B, C [B, L, G, Ds] (one
// dtype of float32, float16, bfloat16; head h reads group h / (H / G)); A (-exp(A_log)), D [H], dt [B, L, H]
// (softplus'd and clipped) and state [B, H, Dh, Ds] (none: zeros) read as float32; mask [B, L] (0: masked
// token) and lengths [B] (the state returned is after token lengths - 1; negative: the incoming one) or none.
// Per token dA = exp(dt A); state = dA state + dt x B^T; y = state . C + D x -> {y in x's dtype, the state
// float32}.
std::vector<mx::array> ssm_update(const mx::array& x, const mx::array& A, const mx::array& B, const mx::array& C,
                                  const mx::array& D, const mx::array& dt, const std::optional<mx::array>& state,
                                  const std::optional<mx::array>& mask, const std::optional<mx::array>& lengths,
                                  mx::StreamOrDevice s = {});

class SsmUpdate : public mx::Primitive {
 public:
  SsmUpdate(mx::Stream stream, bool has_state, bool has_mask, bool has_lengths)
      : mx::Primitive(stream), has_state_(has_state), has_mask_(has_mask), has_lengths_(has_lengths) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmSsmUpdate";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const SsmUpdate&>(other);
    return has_state_ == o.has_state_ && has_mask_ == o.has_mask_ && has_lengths_ == o.has_lengths_;
  }

 private:
  bool has_state_;
  bool has_mask_;
  bool has_lengths_;
};

// RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * weight, as mx.fast.rms_norm.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

// RoPE as mx.fast.rope (forward): x [B, H, L, D] or [B, L, D], any strides; offset int32, one value or
// one per batch row -> contiguous, x's dtype.
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, const mx::array& offset,
               mx::StreamOrDevice s = {});

// silu(gate) * up, as mlx-lm's swiglu.
mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

// y = x @ weight.T for few rows (decode): x [..., K], weight [N, K], float32, K a multiple of 16.
mx::array linear(const mx::array& x, const mx::array& weight, mx::StreamOrDevice s = {});

class Linear : public mx::Primitive {
 public:
  explicit Linear(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmLinear";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// y = x @ dequantize(w, scales, biases).T on MLX's affine layout (mx.quantize), weights never dequantized
// in memory for up to max_rows rows of x: x [..., K] float32; w uint32 [N, K * bits / 32] (bits 4 or 8);
// scales, biases [N, K / group_size] (float32, float16 or bfloat16); group_size a multiple of 16 -> [..., N]
// float32. More rows: blocks of w dequantized to fp32 and multiplied by cblas_sgemm. x_bits 16 or 8 (x86
// with AVX2): the decode rows are rounded to int16 or int8 per block of 32 and multiplied in integer dot
// products (8: llama.cpp's scheme); 32, or elsewhere, they multiply the unpacked weights in fp32.
mx::array quant_linear(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                       int group_size, int bits, int max_rows, int x_bits = 16, mx::StreamOrDevice s = {});

class QuantLinear : public mx::Primitive {
 public:
  QuantLinear(mx::Stream stream, int group_size, int bits, int max_rows, int x_bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), max_rows_(max_rows), x_bits_(x_bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmQuantLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantLinear&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && max_rows_ == o.max_rows_ &&
           x_bits_ == o.x_bits_;
  }

 private:
  int group_size_;
  int bits_;
  int max_rows_;
  int x_bits_;
};

class RMSNorm : public mx::Primitive {
 public:
  RMSNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmRMSNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class RoPE : public mx::Primitive {
 public:
  RoPE(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmRoPE";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RoPE&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

class SiluMul : public mx::Primitive {
 public:
  explicit SiluMul(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "TrillmSiluMul";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

#endif  // TRILLM_KERNEL_BODIES_ONLY

// Work split shared with the GPU kernels (trillm.kernels._attention_kernels): HPG query heads of one KV
// head x QT queries per work item, context partitions of PARTITION_SIZE tokens merged by a reduction.
constexpr int PARTITION_SIZE = 512;
constexpr size_t MAX_PARTIAL_BYTES = size_t{64} << 20;  // the partition outputs' bound per call
// (partitions, tokens per partition) for a call: PARTITION_SIZE each, fewer where the partial outputs
// would pass MAX_PARTIAL_BYTES.
std::pair<int, int> attention_partitions(int batch, int num_q_heads, int num_queries, int head_dim, int max_tokens);
int heads_per_group(int rep, int head_dim);
int queries_per_tile(int num_queries, int hpg);

// Ask the kernel to back `a`'s memory (evaluated first) with transparent huge pages: MADV_HUGEPAGE, then
// MADV_COLLAPSE for what is already populated. Only whole 2 MiB pages inside the buffer are covered.
struct HugePageResult {
  size_t advised = 0;  // bytes marked MADV_HUGEPAGE
  size_t collapsed = 0;  // bytes collapsed into huge pages now
  std::string error;  // why less than the whole buffer was covered ("" when all went well)
};
#ifndef TRILLM_KERNEL_BODIES_ONLY
HugePageResult advise_hugepages(const mx::array& a);
#endif

// Run fn(begin, end) over [0, n) in chunks of at least `grain`, across the pool's threads.
void parallel_chunks(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

}  // namespace trillm_cpu
