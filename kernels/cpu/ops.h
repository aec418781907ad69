// trillm's CPU kernels as MLX primitives: each op builds one graph node whose eval_cpu runs the kernel.
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace trillm_cpu {

// Paged attention over the KV pool (layout: trillm.kernels.layout), decode (L == 1) and prefill chunks
// (L > 1) with the cached prefix, reading K/V through the block tables. Shapes as paged_attention_ref:
// q [B, Hq, L, D]; k_pool, v_pool [num_blocks, bs, Hkv, D]; block_tables int32 [B, max_blocks];
// context_lens int32 [B]; sinks [Hq] or none; window 0 = none -> [B, Hq, L, D] in q's dtype.
mx::array paged_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                          const mx::array& block_tables, const mx::array& context_lens, float scale, int window,
                          const std::optional<mx::array>& sinks, mx::StreamOrDevice s = {});

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, float scale, int window, bool has_sinks)
      : mx::Primitive(stream), scale_(scale), window_(window), has_sinks_(has_sinks) {}

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
};

// Work split shared with the GPU kernels (trillm.kernels._attention_kernels): HPG query heads of one KV
// head x QT queries per work item, context partitions of PARTITION_SIZE tokens merged by a reduction.
constexpr int PARTITION_SIZE = 512;
int heads_per_group(int rep, int head_dim);
int queries_per_tile(int num_queries, int hpg);

}  // namespace trillm_cpu
