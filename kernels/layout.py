"""The paged KV pool layout: the one contract every kernel, reference and the engine share.

Per attention layer there is one K pool and one V pool, each

    pool: [num_blocks, block_size, num_kv_heads, head_dim]   (the model's dtype; fp32 on CPU)

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
`window` of them), so decode is L == 1 and a prefill chunk attends to its cached prefix through the table.

Block 0 is never handed to a sequence: the engine reserves it as the padding target, so a stray read of
padding lands in memory that exists.
"""

from __future__ import annotations

RESERVED_BLOCK = 0  # padding target for block tables; never allocated to a sequence
