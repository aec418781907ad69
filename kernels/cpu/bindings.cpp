// Python bindings: the module shares MLX's nanobind domain, so mx.array passes through unchanged.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_trillm_cpu, m) {
  m.doc() = "trillm's CPU kernels as MLX primitives";
  m.def("paged_attention", &trillm_cpu::paged_attention, "q"_a, "k_pool"_a, "v_pool"_a, "block_tables"_a,
        "context_lens"_a, nb::kw_only(), "scale"_a, "window"_a = 0, "sinks"_a = nb::none(),
        "softcap"_a = 0.0f, "chunk"_a = 0, "k_scale"_a = nb::none(), "v_scale"_a = nb::none(),
        "stream"_a = nb::none(), "Paged attention over the KV pool (see trillm.kernels.paged_attention).");
  m.def("mla_attention", &trillm_cpu::mla_attention, "q_latent"_a, "q_pe"_a, "latent_pool"_a, "pe_pool"_a,
        "block_tables"_a, "context_lens"_a, nb::kw_only(), "scale"_a, "stream"_a = nb::none(),
        "Paged MLA attention over the latent cache (see trillm.kernels.mla_attention).");
  m.def("mla_plan", [](int batch, int num_heads, int num_queries, int max_tokens) {
          auto p = trillm_cpu::mla_plan(batch, num_heads, num_queries, max_tokens,
                                        trillm_cpu::ThreadPool::get().size());
          return nb::make_tuple(p.hpi, p.qt, p.num_parts, p.part_size);
        }, "batch"_a, "num_heads"_a, "num_queries"_a, "max_tokens"_a,
        "The MLA primitive's split on this pool: (heads per item, queries per item, partitions, partition size).");
  m.def("rms_norm", &trillm_cpu::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
        "RMSNorm over the last axis (as mx.fast.rms_norm).");
  m.def("gated_delta", &trillm_cpu::gated_delta, "q"_a, "k"_a, "v"_a, "g"_a, "beta"_a, "state"_a,
        "mask"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "The gated delta rule over T tokens: [y, new state] (see trillm.kernels.gated_delta).");
  m.def("ssm_update", &trillm_cpu::ssm_update, "x"_a, "A"_a, "B"_a, "C"_a, "D"_a, "dt"_a, "state"_a = nb::none(),
        "mask"_a = nb::none(), "lengths"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "Mamba-2's state-space update over L tokens: [y, new state] (see trillm.kernels.ssm_update).");
  m.def("rope", &trillm_cpu::rope, "x"_a, "dims"_a, nb::kw_only(), "traditional"_a, "base"_a, "scale"_a,
        "offset"_a, "stream"_a = nb::none(), "RoPE (as mx.fast.rope, forward); offset: int32 [1] or [B].");
  m.def("silu_mul", &trillm_cpu::silu_mul, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up.");
  m.def("linear", &trillm_cpu::linear, "x"_a, "weight"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ weight.T for few rows (float32; K a multiple of 16).");
  m.def("quant_linear", &trillm_cpu::quant_linear, "x"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(),
        "group_size"_a, "bits"_a, "max_rows"_a, "x_bits"_a = 16, "stream"_a = nb::none(),
        "x @ dequantize(w, scales, biases).T on MLX's affine layout, bits 4 or 8 (see trillm.kernels.quant_linear);"
        " x_bits 16 / 8: decode rows rounded to that per block of 32 where the ISA has integer dot products, 32: fp32.");
  m.def("advise_hugepages", [](const mx::array& a) {
          auto r = trillm_cpu::advise_hugepages(a);
          return nb::make_tuple(r.advised, r.collapsed, r.error);
        }, "a"_a, "Back a's memory with transparent huge pages: (bytes advised, bytes collapsed, error or '').");
  m.def("num_threads", [] { return trillm_cpu::ThreadPool::get().size(); },
        "Threads the kernels split their work across (TRILLM_CPU_THREADS, default: usable cores).");
  m.def("heads_per_group", &trillm_cpu::heads_per_group, "rep"_a, "head_dim"_a);
  m.def("queries_per_tile", &trillm_cpu::queries_per_tile, "num_queries"_a, "hpg"_a);
  m.attr("PARTITION_SIZE") = trillm_cpu::PARTITION_SIZE;
  m.attr("MAX_PARTIAL_BYTES") = trillm_cpu::MAX_PARTIAL_BYTES;
  m.def("attention_partitions", [](int batch, int num_q_heads, int num_queries, int head_dim, int max_tokens) {
          auto [parts, size] = trillm_cpu::attention_partitions(batch, num_q_heads, num_queries, head_dim, max_tokens);
          return nb::make_tuple(parts, size);
        }, "batch"_a, "num_q_heads"_a, "num_queries"_a, "head_dim"_a, "max_tokens"_a,
        "The paged attention primitive's context split: (partitions, tokens per partition).");
  m.attr("SIMD") = TRILLM_SIMD;  // the ISA it was built for (simd.h)
  m.attr("LANES") = trillm_cpu::W;
  m.attr("VECTOR_REGISTERS") = trillm_cpu::NREG;
}
