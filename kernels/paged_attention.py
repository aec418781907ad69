"""Attention over the paged KV pool: decode (L == 1) and one prefill chunk (L > 1) through block tables.

Pool layout and the meaning of block_tables / context_lens: see `trillm.kernels.layout`.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels._dispatch import kernel_backend
from trillm.kernels.kv_cache import _gather_blocks
from trillm.kernels import _attention_kernels as _k


def paged_attention_ref(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Pure-mx paged attention: gather K/V through the tables, mask, then `mx.fast` SDPA (GQA native).

    Shapes: q [B, Hq, L, D]; k_pool, v_pool [num_blocks, bs, Hkv, D]; block_tables int32 [B, max_blocks];
    context_lens int32 [B]; sinks [Hq] or None -> [B, Hq, L, D] in q's dtype.
    Query i of row b sits at position context_lens[b] - L + i and sees positions <= its own
    (and > pos - window when window is set). The whole table width is gathered, so pass a table trimmed
    to the batch's longest row; reading max(context_lens) here would force a host sync every layer.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if q.shape[2] == 1:
        return _decode_ref(q, k_pool, v_pool, block_tables, context_lens, scale, window, sinks)
    keys = _gather_blocks(k_pool, block_tables)  # [B, Hkv, N, D], N = max_blocks * bs
    values = _gather_blocks(v_pool, block_tables)
    mask = attention_mask(context_lens, q.shape[2], keys.shape[2], window)
    if sinks is not None and sinks.dtype != q.dtype:
        sinks = sinks.astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)


def _decode_ref(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array, context_lens: mx.array,
    scale: float, window: int | None, sinks: mx.array | None,
) -> mx.array:  # fmt: skip
    """Decode without the head-major transpose: block-diagonal queries against [B, N, Hkv * D] K/V.

    On CPU the [B, N, Hkv, D] -> [B, Hkv, N, D] copy costs more than the attention itself; multiplying
    queries that are zero outside their KV head's D-slice reads gathered K/V as they lie, for Hkv x the
    (negligible at L == 1) flops: 1.3-2x faster than the SDPA path from B = 8 up (bench_kernels).
    """
    b, hq, _, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    n = block_tables.shape[1] * bs
    rep = hq // hkv
    keys = k_pool[block_tables].reshape(b, n, hkv * d)  # whole blocks: [B, N, Hkv * D]
    values = v_pool[block_tables].reshape(b, n, hkv * d)
    slices = mx.eye(hkv, dtype=q.dtype).reshape(1, hkv, 1, hkv, 1)
    q_bd = ((q * scale).reshape(b, hkv, rep, 1, d) * slices).reshape(b, hq, hkv * d)
    scores = (q_bd @ keys.swapaxes(1, 2)).astype(mx.float32)  # [B, Hq, N]
    mask = attention_mask(context_lens, 1, n, window).reshape(b, 1, n)
    scores = mx.where(mask, scores, mx.array(-mx.inf, mx.float32))
    if sinks is not None:  # a sink is one more logit in each head's softmax, with no value
        sink_col = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, hq, 1), (b, hq, 1))
        probs = mx.softmax(mx.concatenate([sink_col, scores], axis=-1), axis=-1)[..., 1:]
    else:
        probs = mx.softmax(scores, axis=-1)
    out = (probs.astype(values.dtype) @ values).reshape(b, hkv, rep, hkv, d)  # [B, group, rep, slice, D]
    out = mx.take_along_axis(out, mx.arange(hkv).reshape(1, hkv, 1, 1, 1), axis=3)
    return out.reshape(b, hq, 1, d).astype(q.dtype)


def attention_mask(context_lens: mx.array, num_queries: int, num_keys: int, window: int | None) -> mx.array:
    """Boolean [B, 1, L, N]: True where query i of row b may attend to key position j.

    Query i sits at pos = context_lens[b] - L + i; allowed: j <= pos and (window is None or j > pos - window).
    """
    pos = context_lens.astype(mx.int32)[:, None, None, None] - num_queries + mx.arange(num_queries)[:, None]
    j = mx.arange(num_keys)
    allowed = j <= pos
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        allowed = allowed & (j > pos - window)
    return allowed


def paged_attention_metal(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """`paged_attention` as Metal kernels (decode: flash-decoding; L > 1: prefill). Shapes as the reference."""
    return _k.paged_attention_kernel("metal", q, k_pool, v_pool, block_tables, context_lens, scale, window, sinks)


def paged_attention_cuda(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """`paged_attention` as CUDA kernels (decode: flash-decoding; L > 1: prefill). Shapes as the reference."""
    return _k.paged_attention_kernel("cuda", q, k_pool, v_pool, block_tables, context_lens, scale, window, sinks)


def paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Causal attention of q [B, Hq, L, D] over each row's cached K/V -> [B, Hq, L, D] in q's dtype.

    L == 1 is decode; L > 1 is one prefill chunk whose own K/V are already written to the pool
    (kv_write first), attending to its cached prefix through the table. Kernel on Metal/CUDA, else
    the reference (TRILLM_KERNELS=ref forces it).
    """
    backend = kernel_backend()
    if backend is None or not _k.kernel_supports(q, k_pool):
        return paged_attention_ref(
            q, k_pool, v_pool, block_tables, context_lens, scale=scale, window=window, sinks=sinks
        )
    return _k.paged_attention_kernel(backend, q, k_pool, v_pool, block_tables, context_lens, scale, window, sinks)
