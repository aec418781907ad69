"""Paged MLA attention (DeepSeek V2/V3, Kimi, MiniCPM3, GLM-4 MLA variants) over a latent cache.

mlx-lm's DeepseekV3Attention caches, per token, the compressed KV `kv_latent` (kv_lora_rank = R wide, after
kv_a_layernorm) and the RoPE'd key part `k_pe` (qk_rope_head_dim = P wide), one "head" each. trillm's pool
holds them per layer as (layout: `trillm.kernels.layout`)

    latent_pool: [num_blocks, block_size, 1, R]   (the pool's "keys")
    pe_pool:     [num_blocks, block_size, 1, P]   (the pool's "values")

Attention is then MQA with a wide head, in the absorbed form mlx-lm uses for decode: the caller passes
q_latent = embed_q(q_nope) [B, H, L, R] and the RoPE'd q_pe [B, H, L, P];

    scores = scale * (q_latent . latent + q_pe . k_pe)     causal by position, as paged attention
    output = softmax(scores) . latent                      [B, H, L, R]

and applies `unembed_out` to the output. (For prefill mlx-lm expands the latent into per-head keys and values
instead; the absorbed form is the same sum reordered.) As `trillm.kernels.paged_attention`: the pure-mx
reference `mla_attention_ref`, the CPU primitive `mla_attention_cpu` (kernels/cpu/mla_attention.cpp), one
Metal/CUDA kernel body (`mla_attention_gpu`; never yet run on a GPU: checked by the
CPU emulator and the host-side compiles), the dispatcher `mla_attention`, and `OP` for the start-up
self-check, which runs it only for models whose shapes declare MLA (`ModelShapes.kv_lora_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import Case, Kernel, KernelOp, KernelSpec, float32_params, gpu_backend, int32_params, kernel_backend
from trillm.kernels.layout import ModelShapes, shuffled_tables
from trillm.kernels.paged_attention import (
    GPU_DTYPES, GRID_INDICES, MAX_ROWS_X_D, MERGE_SIMDGROUPS, NUM_SIMDGROUPS, PARTIAL_EPILOGUE, TOLERANCES,
    attention_mask, int32_tables, launch_attention, launch_plan,
)  # fmt: skip

CPU_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

# ---------------------------------------------------------------- Metal / CUDA
# The paged attention kernels' structure (trillm.kernels.paged_attention) with one KV head: a threadgroup
# owns R = QT * HPG rows (QT queries x HPG heads), each lane DPL = D / 32 latent values and EPL = P / 32
# k_pe values; scores are q_latent . latent + q_pe . k_pe, values the latent itself. Split decode writes
# partials that paged attention's reduction kernel merges (no sinks).
# Template constants: T, D (kv_lora_rank), P (RoPE dim), BS, HQ, HPG, QT, NW. meta (int32): [max_blocks,
# num_parts, part_size, L]; scale (float32): [scale].
_MLA_INPUTS = ("q_latent", "q_pe", "latent_pool", "pe_pool", "block_tables", "context_lens", "scale", "meta")
_MLA_BODY = """
  constexpr int DPL = D / 32;
  constexpr int EPL = P / 32;
  constexpr int R = QT * HPG;
""" + GRID_INDICES + """  const int ctx = context_lens[b];
  const float sc = scale[0];

  int pos[QT];
  int tok_hi = 0;
  UNROLL for (int qi = 0; qi < QT; ++qi) {
    const int i = qtile * QT + qi;
    pos[qi] = (i < L) ? ctx - L + i : -1;
    if (i < L) {
      tok_hi = MAXI(tok_hi, pos[qi] + 1);
    }
  }
  tok_hi = MINI(tok_hi, max_blocks * BS);  // tokens past the table do not exist
  float qv[R][DPL];
  float qe[R][EPL];
  float m[R];
  float l[R];
  float acc[R][DPL];
  UNROLL for (int r = 0; r < R; ++r) {
    const int i = qtile * QT + r / HPG;
    const size_t row = (size_t)(b * HQ + h0 + r % HPG) * L + MINI(i, L - 1);
    UNROLL for (int e = 0; e < DPL; ++e) {
      qv[r][e] = static_cast<float>(q_latent[row * D + lane * DPL + e]) * sc;
      acc[r][e] = 0.0f;
    }
    UNROLL for (int e = 0; e < EPL; ++e) {
      qe[r][e] = static_cast<float>(q_pe[row * P + lane * EPL + e]) * sc;
    }
    m[r] = NEG_INF;
    l[r] = 0.0f;
  }

  const int start = part * part_size;
  const int end = MINI((part + 1) * part_size, tok_hi);
  int cur = -1;
  auto lb = latent_pool;
  auto pb = pe_pool;
  for (int t = start + warp; t < end; t += NW) {
    const int j = t / BS;
    if (j != cur) {
      cur = j;
      const size_t blk = (size_t)block_tables[b * max_blocks + j];
      lb = latent_pool + blk * (BS * D);
      pb = pe_pool + blk * (BS * P);
    }
    const int off = t - j * BS;
    float lf[DPL];
    float pf[EPL];
    UNROLL for (int e = 0; e < DPL; ++e) {
      lf[e] = static_cast<float>(lb[off * D + lane * DPL + e]);
    }
    UNROLL for (int e = 0; e < EPL; ++e) {
      pf[e] = static_cast<float>(pb[off * P + lane * EPL + e]);
    }
    UNROLL for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      UNROLL for (int e = 0; e < DPL; ++e) {
        s += qv[r][e] * lf[e];
      }
      UNROLL for (int e = 0; e < EPL; ++e) {
        s += qe[r][e] * pf[e];
      }
      s = simd_sum(s);
      const bool ok = t <= pos[r / HPG];
      const float mn = ok ? MAXF(m[r], s) : m[r];
      const float alpha = EXPF(m[r] - mn);
      const float p = ok ? EXPF(s - mn) : 0.0f;
      l[r] = l[r] * alpha + p;
      m[r] = mn;
      UNROLL for (int e = 0; e < DPL; ++e) {
        acc[r][e] = acc[r][e] * alpha + p * lf[e];
      }
    }
  }

""" + MERGE_SIMDGROUPS
_MLA_FINAL_EPILOGUE = """
      out[row * D + d] = static_cast<T>(S > 0.0f ? O / S : 0.0f);
"""
MLA_FINAL = KernelSpec("mla_attn_final", _MLA_INPUTS, ("out",), _MLA_BODY.replace("@EPILOGUE@", _MLA_FINAL_EPILOGUE))
MLA_PARTIAL = KernelSpec("mla_attn_partial", _MLA_INPUTS, ("o_part", "m_part", "l_part"),
                         _MLA_BODY.replace("@EPILOGUE@", PARTIAL_EPILOGUE))  # fmt: skip


def mla_attention_kernel(
    backend: str,
    q_latent: mx.array,
    q_pe: mx.array,
    latent_pool: mx.array,
    pe_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
) -> mx.array:
    """Launch the MLA kernels on `backend` (any name in backend.FACTORIES). Shapes as the reference."""
    _check_shapes(q_latent, q_pe, latent_pool, pe_pool)
    b, h, length, d = q_latent.shape
    p = q_pe.shape[-1]
    bs = latent_pool.shape[1]
    if d % 32 or p % 32:
        raise ValueError(f"kv_lora_rank {d} and the RoPE dim {p} must be multiples of 32 for the GPU kernels")
    if not q_pe.dtype == latent_pool.dtype == pe_pool.dtype == q_latent.dtype:
        raise ValueError("q_latent, q_pe and the pools must share a dtype")
    max_blocks = block_tables.shape[1]
    plan = launch_plan(backend, b, h, 1, length, d, max_blocks * bs)  # one KV head: HPG divides H
    inputs = [q_latent, q_pe, latent_pool, pe_pool, *int32_tables(block_tables, context_lens), float32_params(scale),
              int32_params(max_blocks, plan.num_parts, plan.part_size, length)]
    template = [("T", q_latent.dtype), ("D", d), ("P", p), ("BS", bs), ("HQ", h), ("HPG", plan.hpg),
                ("QT", plan.qt), ("NW", NUM_SIMDGROUPS)]  # fmt: skip
    return launch_attention(backend, (MLA_FINAL, MLA_PARTIAL), q_latent, inputs, template, plan, None)


def _check_shapes(q_latent: mx.array, q_pe: mx.array, latent_pool: mx.array, pe_pool: mx.array) -> None:
    b, h, length, r = q_latent.shape
    p = q_pe.shape[-1]
    if q_pe.shape != (b, h, length, p):
        raise ValueError(f"q_pe {q_pe.shape} must be [B, H, L, P] like q_latent {q_latent.shape}")
    if latent_pool.ndim != 4 or latent_pool.shape[2:] != (1, r) or pe_pool.shape != latent_pool.shape[:2] + (1, p):
        raise ValueError(f"pools {latent_pool.shape}, {pe_pool.shape} must be [num_blocks, bs, 1, {r}] and "
                         f"[num_blocks, bs, 1, {p}]")  # fmt: skip


# ---------------------------------------------------------------- reference
def mla_attention_ref(
    q_latent: mx.array,
    q_pe: mx.array,
    latent_pool: mx.array,
    pe_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
) -> mx.array:
    """Pure-mx paged MLA attention -> [B, H, L, R] in q_latent's dtype (see the module docstring).

    Shapes: q_latent [B, H, L, R]; q_pe [B, H, L, P]; latent_pool [num_blocks, bs, 1, R]; pe_pool
    [num_blocks, bs, 1, P]; block_tables int32 [B, max_blocks]; context_lens int32 [B]. Query i of row b sits
    at position context_lens[b] - L + i and sees the positions <= its own that the table holds. Scores and
    softmax in float32; the whole table width is gathered (pass a table trimmed to the longest row).
    """
    _check_shapes(q_latent, q_pe, latent_pool, pe_pool)
    b, h, length, r = q_latent.shape
    n = block_tables.shape[1] * latent_pool.shape[1]
    # One latent sequence for every head: [B, N, R] and [B, N, P], whole blocks in table order.
    latent = latent_pool[block_tables].reshape(b, 1, n, r).astype(mx.float32)
    k_pe = pe_pool[block_tables].reshape(b, 1, n, -1).astype(mx.float32)
    ql = q_latent.astype(mx.float32).reshape(b, 1, h * length, r)
    qp = q_pe.astype(mx.float32).reshape(b, 1, h * length, -1)
    scores = (ql @ latent.swapaxes(-1, -2) + qp @ k_pe.swapaxes(-1, -2)) * scale  # [B, 1, H * L, N]
    mask = attention_mask(context_lens, length, n, None)  # [B, 1, L, N]
    scores = mx.where(mask, scores.reshape(b, h, length, n), mx.array(-mx.inf, mx.float32))
    probs = mx.softmax(scores, axis=-1).reshape(b, 1, h * length, n)
    return (probs @ latent).reshape(b, h, length, r).astype(q_latent.dtype)


# ---------------------------------------------------------------- back-ends
def mla_attention_cpu(
    q_latent: mx.array,
    q_pe: mx.array,
    latent_pool: mx.array,
    pe_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
) -> mx.array:
    """`mla_attention` as a primitive of trillm's CPU extension (kernels/cpu/mla_attention.cpp): every head
    of an item reads each latent token once, straight from the pool. Shapes as the reference; raises
    RuntimeError when the extension is unavailable."""
    ext = cpu_ext.require()
    _check_shapes(q_latent, q_pe, latent_pool, pe_pool)
    out: mx.array = ext.mla_attention(q_latent, q_pe, latent_pool, pe_pool, block_tables, context_lens, scale=scale)
    return out


def cpu_supports(shapes: ModelShapes) -> str | None:
    """Why the CPU primitive cannot run these shapes (or None). Asking loads, or first builds, the extension."""
    if not shapes.mla:
        return "the model has no MLA layers"
    if shapes.kv_lora_rank % 16 or shapes.qk_rope_head_dim % 16:
        return (f"kv_lora_rank {shapes.kv_lora_rank} and qk_rope_head_dim {shapes.qk_rope_head_dim} are not "
                "multiples of 16 (the primitive's vector width)")  # fmt: skip
    return cpu_ext.supports(shapes, CPU_DTYPES)


def mla_attention_gpu(
    q_latent: mx.array, q_pe: mx.array, latent_pool: mx.array, pe_pool: mx.array, block_tables: mx.array,
    context_lens: mx.array, *, scale: float,
) -> mx.array:  # fmt: skip
    """`mla_attention` as this GPU's kernels (Metal or CUDA). Shapes as the reference."""
    return mla_attention_kernel(gpu_backend(), q_latent, q_pe, latent_pool, pe_pool, block_tables, context_lens,
                                scale=scale)


def gpu_supports(shapes: ModelShapes) -> str | None:
    """Why the Metal/CUDA MLA kernels cannot run these shapes, or None."""
    if not shapes.mla:
        return "the model has no MLA layers"
    r, p = shapes.kv_lora_rank, shapes.qk_rope_head_dim
    if r % 32 or p % 32 or r > MAX_ROWS_X_D:
        return f"kv_lora_rank {r} and qk_rope_head_dim {p} are not multiples of 32 (kv_lora_rank up to {MAX_ROWS_X_D})"
    if shapes.dtype not in GPU_DTYPES:
        return f"dtype {shapes.dtype} is not float32/float16/bfloat16"
    return None


KERNELS: dict[str, Kernel] = {
    "metal": Kernel(mla_attention_gpu, gpu_supports),
    "cuda": Kernel(mla_attention_gpu, gpu_supports),
    "cpu": Kernel(mla_attention_cpu, cpu_supports),
}


class MlaAttentionFn(Protocol):
    """The signature every implementation shares (`mla_attention_ref`'s)."""

    def __call__(
        self, q_latent: mx.array, q_pe: mx.array, latent_pool: mx.array, pe_pool: mx.array,
        block_tables: mx.array, context_lens: mx.array, *, scale: float,
    ) -> mx.array: ...  # fmt: skip


# ---------------------------------------------------------------- dispatcher
def mla_attention(
    q_latent: mx.array,
    q_pe: mx.array,
    latent_pool: mx.array,
    pe_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
) -> mx.array:
    """Causal MLA attention over each row's cached latent -> [B, H, L, R] (then `unembed_out`).

    L == 1 is decode; L > 1 a prefill chunk whose own latent / k_pe are already in the pools. Runs this
    back-end's kernel when it has one for these shapes, else the reference. Unchecked: the engine runs what
    its start-up self-check chose (`KernelSelection.mla_attention`).
    """
    kernel = None
    if latent_pool.dtype == q_latent.dtype == q_pe.dtype == pe_pool.dtype:
        shapes = ModelShapes(q_latent.shape[1], 1, q_latent.shape[3], latent_pool.shape[1], q_latent.dtype,
                             kv_lora_rank=q_latent.shape[3], qk_rope_head_dim=q_pe.shape[3])  # fmt: skip
        kernel = OP.kernel_for(kernel_backend(), shapes)
    impl: MlaAttentionFn = kernel.fn if kernel is not None else mla_attention_ref
    return impl(q_latent, q_pe, latent_pool, pe_pool, block_tables, context_lens, scale=scale)


# ---------------------------------------------------------------- self-check cases
@dataclass(frozen=True, slots=True)
class MlaBatch:
    """Random latent / k_pe for rows of given lengths, in shuffled pool blocks, with the queries."""

    q_latent: mx.array  # [B, H, L, R]
    q_pe: mx.array  # [B, H, L, P]
    latent_pool: mx.array  # [num_blocks, bs, 1, R]
    pe_pool: mx.array  # [num_blocks, bs, 1, P]
    block_tables: mx.array  # int32 [B, max_blocks]; padding -> RESERVED_BLOCK
    context_lens: mx.array  # int32 [B]

    @property
    def args(self) -> tuple[mx.array, ...]:
        return (self.q_latent, self.q_pe, self.latent_pool, self.pe_pool, self.block_tables, self.context_lens)


def random_mla_batch(shapes: ModelShapes, lens: list[int], num_queries: int, seed: int = 0) -> MlaBatch:
    """As `layout.random_batch`, for the MLA pools: block 0 reserved, one padding column per table, random
    values in slots no row owns (a kernel reading outside a row's blocks shows)."""
    bs, r, p = shapes.block_size, shapes.kv_lora_rank, shapes.qk_rope_head_dim
    num_blocks, tables = shuffled_tables(lens, bs, seed)
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    b, h = len(lens), shapes.num_q_heads
    return MlaBatch(
        q_latent=mx.random.normal((b, h, num_queries, r), key=k1).astype(shapes.dtype),
        q_pe=mx.random.normal((b, h, num_queries, p), key=k2).astype(shapes.dtype),
        latent_pool=mx.random.normal((num_blocks, bs, 1, r), key=k3).astype(shapes.dtype),
        pe_pool=mx.random.normal((num_blocks, bs, 1, p), key=k4).astype(shapes.dtype),
        block_tables=mx.array(tables, dtype=mx.int32),
        context_lens=mx.array(lens, dtype=mx.int32),
    )  # fmt: skip


def _case(shapes: ModelShapes, label: str, lens: list[int], num_queries: int, seed: int) -> Case:
    batch = random_mla_batch(shapes, lens, num_queries, seed)
    # Scores of spread ~1 (as a trained model's): random unit-normal q and latent dot to ~sqrt(R + P).
    scale = (shapes.kv_lora_rank + shapes.qk_rope_head_dim) ** -0.5
    return Case(label, batch.args, {"scale": scale})


CHECK_BATCHES = (1, 9)
CHECK_QUERIES = (1, 3)  # plus the model's prefill chunk
CHECK_LONG_CONTEXT = 1029  # several partitions in decode at batch 1


def _check_cases(shapes: ModelShapes) -> list[Case]:
    """Decode and prefill chunks (L 1, 3, chunk) at B 1 and 9, short and ragged rows and one long one."""
    cases: list[Case] = []
    top = shapes.max_context
    for num_queries in sorted({*CHECK_QUERIES, min(shapes.chunk, top)}):
        for batch in CHECK_BATCHES:
            ladder = [num_queries + k for k in (0, 1, shapes.block_size - 1, shapes.block_size, 2 * shapes.block_size + 3)]
            lens = [min(ladder[i % len(ladder)], top) for i in range(batch)]
            lens[-1] = min(max(CHECK_LONG_CONTEXT, num_queries), top)
            label = f"MLA B={batch} L={num_queries} contexts {min(lens)}..{max(lens)}"
            cases.append(_case(shapes, label, lens, num_queries, seed=200 + len(cases)))
    return cases


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    top = shapes.max_context
    big = shapes.max_batch
    chunk = min(shapes.chunk, top)
    return [
        # (the first word is the phase: the self-check decides decode and prefill apart)
        _case(shapes, "decode B=1 (MLA)", [min(2048, top)], 1, seed=300),
        _case(shapes, f"decode B={big} (MLA)", [min(512, top, max(1, 65536 // big))] * big, 1, seed=301),
        _case(shapes, f"prefill L={chunk} (MLA)", [min(2 * chunk, top)], chunk, seed=302),
    ]


def _applies(shapes: ModelShapes) -> bool:
    return shapes.mla


def _phase(q_latent: mx.array, *_: object, **__: object) -> str:
    """Decode (one query per row) or prefill, decided apart by the self-check as paged attention's."""
    return "decode" if q_latent.shape[2] == 1 else "prefill"


OP = KernelOp(
    name="mla_attention", reference=mla_attention_ref, kernels=KERNELS, check_cases=_check_cases,
    timing_cases=_timing_cases, tolerances=TOLERANCES, applies=_applies, phase_of=_phase,
)  # fmt: skip
