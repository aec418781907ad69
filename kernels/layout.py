"""The paged KV pool layout: the one contract every kernel, reference and the engine share.

Per attention layer there is one K pool and one V pool, each

    pool: [num_blocks, block_size, num_kv_heads, head_dim]   (the model's dtype, fp32 on CPU; or the cache's:
                                                              float16, bfloat16, or int8 beside a scale pool)

i.e. flash-attention's paged layout. A *slot* is one token position in the pool:

    slot = block_id * block_size + offset_in_block,   so   pool.reshape(-1, num_kv_heads, head_dim)[slot]

holds that token's K (or V) for every KV head, contiguous (num_kv_heads * head_dim elements).

Per step the engine passes:
    block_tables: int32 [B, max_blocks]  row b's blocks in order; entries past its last block are padding
                                         (any valid block id, never read past context_lens[b]); the table's
                                         width bounds the work (the attention reference gathers all of it,
                                         the kernels size their partitions by it), so trim it to the
                                         batch's longest row
    context_lens: int32 [B]              tokens valid in row b's cache, *including* this step's new tokens
    slot_mapping: int32 [T]              the slot each new token is written to (T = B * L, row-major)

Queries are [B, Hq, L, D] with Hq a multiple of num_kv_heads (GQA/MQA); query i of row b sits at absolute
position context_lens[b] - L + i and attends causally to positions <= its own (optionally only the last
`window` of them, or only those of its own aligned `chunk`), so decode is L == 1 and a prefill chunk attends
to its cached prefix through the table.

Block 0 is never handed to a sequence: the engine reserves it as the padding target, so a stray read of
padding lands in memory that exists.

Attention variants (keyword arguments of every paged attention implementation, and `ModelShapes` fields
the start-up self-check builds its cases from):
    scale                 multiplies q . k first
    softcap: float|None   logit soft-capping (Gemma 2): scores = tanh(scores / softcap) * softcap, after the
                          scale and before the mask, the sinks and the softmax (ModelShapes.softcap)
    window: int|None      sliding window: query at pos sees positions > pos - window only; per layer
                          (ModelShapes.layer_windows lists every layer's, None for full attention, so the
                          self-check compiles and checks each distinct window's variant)
    chunk: int|None       chunked attention (Llama 4): query at pos sees positions >= pos - pos % chunk only,
                          i.e. k // chunk == pos // chunk, its own aligned chunk (ModelShapes.attention_chunk:
                          `ModelShapes.chunk` is the prefill chunk). With a window too, both bounds apply.
    sinks: [Hq] | None    attention sinks (gpt-oss): one extra logit per head in the softmax, with no value
                          (ModelShapes.sinks)

The int8 cache (`--kv-cache-dtype int8`; `ModelShapes.kv_dtype`): K and V pools of int8, each with a float32
scale pool [num_blocks, block_size, num_kv_heads], one scale per token and KV head (trillm.kernels.kv_write:
written by `kv_write_int8`; value = q * scale). The int4 cache (`kv_dtype="int4"`; CPU primitive and reference):
uint8 pools [num_blocks, block_size, num_kv_heads, head_dim / 2], two values a byte, with float32
(scale, min) pools [num_blocks, block_size, num_kv_heads, head_dim / 32, 2] (`kv_write_int4`). Attention takes them as `k_scale=` / `v_scale=`. A float cache
of another dtype than the queries' (float16 K/V for float32 queries) needs no scales.

MLA layers (DeepSeek V2/V3 and kin; `trillm.kernels.mla_attention`) keep the same two pools per layer with
one "KV head" each: the K pool holds the compressed latent and the V pool the RoPE part k_pe,

    latent_pool: [num_blocks, block_size, 1, kv_lora_rank]       pe_pool: [num_blocks, block_size, 1, qk_rope_head_dim]

written through the same slot_mapping and read through the same block_tables / context_lens (ModelShapes:
kv_lora_rank and qk_rope_head_dim > 0; the self-check then checks MLA attention instead of paged attention).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx

from trillm.kernels.kv_write import quantize_int4, quantize_int8

RESERVED_BLOCK = 0  # padding target for block tables; never allocated to a sequence
KV_DTYPES = (None, "float32", "float16", "bfloat16", "int8", "int4")  # ModelShapes.kv_dtype


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What the kernels see of one model on one engine: the pool layout, the attention flavour, the bounds.

    The start-up self-check runs each kernel on these shapes; the dispatchers build one per call to ask
    whether a kernel handles it (the bounds then keep their defaults).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: mx.Dtype
    window: int | None = None  # sliding-window attention
    sinks: bool = False  # attention sinks (one extra logit per head)
    max_batch: int = 9  # most sequences in one decode step
    chunk: int = 64  # prefill chunk (query tokens per row)
    max_context: int = 4096  # longest context a row can reach
    # The rest of the model, for the ops outside attention (norms, RoPE, SwiGLU, linear); 0: derived, as
    # hidden = num_q_heads * head_dim, intermediate = 8/3 x hidden (llama's), vocab = 32000.
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    # Attention variants beyond `window` / `sinks` (see the module docstring).
    softcap: float | None = None  # logit soft-capping (Gemma 2): scores = tanh(scores / softcap) * softcap
    layer_windows: tuple[int | None, ...] = ()  # every layer's window (None: full attention); (): `window`
    # Chunked attention (Llama 4; the kernels' `chunk` keyword): keys of the query's own aligned chunk of this
    # many positions only; None: none. Beside `window` (both set: both bounds), one per shapes: the engine
    # builds shapes per distinct layer kind.
    attention_chunk: int | None = None
    kv_lora_rank: int = 0  # MLA (DeepSeek V2/V3): the latent's width; 0: no MLA layers
    qk_rope_head_dim: int = 0  # MLA: the RoPE part's width (k_pe)
    # The formats of the linear weights kept quantized (MLX's affine layout): (bits, group_size, dtype of
    # the scales and biases, e.g. "float16") each; (): none (every weight is a float matrix).
    quantization: tuple[tuple[int, int, str], ...] = ()
    # Gated delta-net layers (Qwen3-Next, Qwen3.5; trillm.kernels.gated_delta): (key heads, value heads, key
    # dim, value dim); (): none.
    delta_net: tuple[int, ...] = ()
    # Mamba-2 mixers (Mamba-2, Nemotron-H, Falcon-H1; trillm.kernels.ssm_update): (heads, groups, head dim,
    # state size); (): none.
    ssm: tuple[int, ...] = ()
    # Depthwise causal convolutions (recurrent mixers' short conv; trillm.kernels.conv1d): (channels, kernel
    # width) of the first; (): none.
    conv: tuple[int, ...] = ()
    # The KV pool's dtype, by name ("float32", "float16", "bfloat16", or "int8": int8 values beside float32
    # scales, see the module docstring); None: `dtype`, the model's.
    kv_dtype: str | None = None

    @property
    def int8_kv(self) -> bool:
        return self.kv_dtype == "int8"

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows the model's layers attend with, in first-seen order (None: full attention)."""
        return tuple(dict.fromkeys(self.layer_windows or (self.window,)))

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def hidden(self) -> int:
        return self.hidden_size or self.num_q_heads * self.head_dim

    @property
    def intermediate(self) -> int:
        return self.intermediate_size or -(-8 * self.hidden // 3 // 16) * 16

    @property
    def vocab(self) -> int:
        return self.vocab_size or 32000

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if min(self.block_size, self.head_dim, self.max_batch, self.chunk, self.max_context) < 1:
            raise ValueError(f"shapes must be positive: {self}")
        for w in (self.window, *self.layer_windows):
            if w is not None and w < 1:
                raise ValueError(f"window must be >= 1, got {w}")
        if self.attention_chunk is not None and self.attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1, got {self.attention_chunk}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0, got {self.softcap}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if min(self.kv_lora_rank, self.qk_rope_head_dim) < 0 or (self.kv_lora_rank > 0) != (self.qk_rope_head_dim > 0):
            raise ValueError(f"MLA needs both kv_lora_rank and qk_rope_head_dim (or neither): {self}")


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Random K/V for rows of given lengths, in shuffled pool blocks, with decode/prefill queries."""

    q: mx.array  # [B, Hq, L, D]
    k_pool: mx.array  # [num_blocks, bs, Hkv, D]
    v_pool: mx.array
    block_tables: mx.array  # int32 [B, max_blocks]; padding -> RESERVED_BLOCK
    context_lens: mx.array  # int32 [B]
    k_scale: mx.array | None = None  # float32 [num_blocks, bs, Hkv]: the int8 cache's scales (else None)
    v_scale: mx.array | None = None

    @property
    def scales(self) -> dict[str, mx.array]:
        """The attention calls' keyword arguments for the pools' scales (none for a float cache)."""
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def shuffled_tables(lens: list[int], block_size: int, seed: int) -> tuple[int, list[list[int]]]:
    """(pool blocks, block tables) for rows of `lens` tokens: block 0 reserved, each row's blocks shuffled
    across the pool, one padding column (RESERVED_BLOCK) per table, one spare block at the end."""
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(per_row) + 1
    order = list(range(1, num_blocks))
    random.Random(seed).shuffle(order)
    width = max(per_row) + 1
    tables = []
    for n_blocks in per_row:
        row, order = order[:n_blocks], order[n_blocks:]
        tables.append(row + [RESERVED_BLOCK] * (width - n_blocks))
    return num_blocks, tables


def random_batch(shapes: ModelShapes, lens: list[int], num_queries: int, seed: int = 0) -> PagedBatch:
    """A batch laid out as above: block 0 reserved, rows in shuffled blocks, one padding column per table.

    Pool slots no row owns hold random values too, so a kernel that reads outside a row's blocks shows.
    The pools are in `shapes.kv_dtype` (int8: the random values quantized per token and head, with scales).
    """
    bs, hkv, d = shapes.block_size, shapes.num_kv_heads, shapes.head_dim
    num_blocks, tables = shuffled_tables(lens, bs, seed)
    k2, k3, k4 = mx.random.split(mx.random.key(seed), 3)
    pool_shape = (num_blocks, bs, hkv, d)
    k_pool, v_pool = mx.random.normal(pool_shape, key=k3), mx.random.normal(pool_shape, key=k4)
    k_scale = v_scale = None
    if shapes.int8_kv:
        (k_pool, k_scale), (v_pool, v_scale) = quantize_int8(k_pool), quantize_int8(v_pool)
    elif shapes.kv_dtype == "int4":
        (k_pool, k_scale), (v_pool, v_scale) = quantize_int4(k_pool), quantize_int4(v_pool)
    else:
        kv_dtype = getattr(mx, shapes.kv_dtype) if shapes.kv_dtype else shapes.dtype
        k_pool, v_pool = k_pool.astype(kv_dtype), v_pool.astype(kv_dtype)
    return PagedBatch(
        q=mx.random.normal((len(lens), shapes.num_q_heads, num_queries, d), key=k2).astype(shapes.dtype),
        k_pool=k_pool, v_pool=v_pool,
        block_tables=mx.array(tables, dtype=mx.int32),
        context_lens=mx.array(lens, dtype=mx.int32),
        k_scale=k_scale, v_scale=v_scale,
    )
