"""Shared builders for kernel tests: a paged pool filled from known dense K/V, and the dense truth."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

TOLERANCES = {mx.float32: (2e-5, 2e-5), mx.float16: (4e-3, 4e-3), mx.bfloat16: (3e-2, 3e-2)}  # atol, rtol


@dataclass(frozen=True)
class PagedCase:
    """Dense per-row K/V/q (the truth's inputs) and the same data laid out in a paged pool."""

    q: mx.array  # [B, Hq, L, D]
    k_pool: mx.array  # [num_blocks, bs, Hkv, D]
    v_pool: mx.array
    block_tables: mx.array  # int32 [B, max_blocks]
    context_lens: mx.array  # int32 [B]
    keys: list[np.ndarray]  # per row [Hkv, n_b, D], already rounded to the dtype
    values: list[np.ndarray]
    lens: list[int]


def make_case(
    lens: list[int], *, bs: int, hkv: int, rep: int, d: int, num_queries: int, dtype: mx.Dtype, seed: int = 0,
    spare_blocks: int = 3,
) -> PagedCase:
    """Random K/V for rows of `lens` tokens, scattered over shuffled pool blocks (block 0 reserved)."""
    rng = np.random.default_rng(seed)
    blocks_per_row = [-(-n // bs) for n in lens]
    max_blocks = max(blocks_per_row) + 1  # one padding column, as the engine may pass
    num_blocks = 1 + sum(blocks_per_row) + spare_blocks
    free = list(rng.permutation(np.arange(1, num_blocks)))
    k_np = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)  # garbage everywhere else
    v_np = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    k_np = np.array(mx.array(k_np).astype(dtype).astype(mx.float32))
    v_np = np.array(mx.array(v_np).astype(dtype).astype(mx.float32))
    tables = np.zeros((len(lens), max_blocks), np.int32)  # padding -> reserved block 0
    keys, values = [], []
    for b, n in enumerate(lens):
        for i in range(blocks_per_row[b]):
            tables[b, i] = free.pop()
        slots = np.array([tables[b, p // bs] * bs + p % bs for p in range(n)])
        keys.append(k_np.reshape(-1, hkv, d)[slots].transpose(1, 0, 2))
        values.append(v_np.reshape(-1, hkv, d)[slots].transpose(1, 0, 2))
    q = mx.array(rng.standard_normal((len(lens), hkv * rep, num_queries, d)).astype(np.float32)).astype(dtype)
    return PagedCase(
        q, mx.array(k_np).astype(dtype), mx.array(v_np).astype(dtype), mx.array(tables),
        mx.array(np.array(lens, np.int32)), keys, values, list(lens),
    )  # fmt: skip


def dense_truth(case: PagedCase, *, scale: float, window: int | None, sinks: mx.array | None,
                softcap: float | None = None) -> mx.array:  # fmt: skip
    """mx.fast SDPA in float32, one row at a time on contiguous K/V with an explicit mask; with softcap, the
    scores written out as mlx-lm's gemma2 Attention does (scale, tanh, mask, softmax, values)."""
    outs = []
    num_queries = case.q.shape[2]
    for b, n in enumerate(case.lens):
        pos = n - num_queries + np.arange(num_queries)[:, None]
        j = np.arange(n)[None, :]
        allowed = (j <= pos) & ((j > pos - window) if window else True)
        if softcap is not None:
            outs.append(_gemma2_attention(case.q[b : b + 1].astype(mx.float32), mx.array(case.keys[b])[None],
                                          mx.array(case.values[b])[None], mx.array(allowed), scale, softcap, sinks))
            continue
        out = mx.fast.scaled_dot_product_attention(
            case.q[b : b + 1].astype(mx.float32), mx.array(case.keys[b])[None], mx.array(case.values[b])[None],
            scale=scale, mask=mx.array(allowed), sinks=None if sinks is None else sinks.astype(mx.float32),
        )  # fmt: skip
        outs.append(out)
    return mx.concatenate(outs, axis=0)


def _gemma2_attention(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float,
                     softcap: float, sinks: mx.array | None) -> mx.array:  # fmt: skip
    """mlx_lm/models/gemma2.py Attention.__call__'s core, with an optional sink logit per head."""
    B, n_heads, L, head_dim = queries.shape
    n_kv_heads = keys.shape[1]
    repeats = n_heads // n_kv_heads
    queries = queries * scale
    queries = queries.reshape(B, n_kv_heads, repeats, L, head_dim)
    keys = mx.expand_dims(keys, 2)
    values = mx.expand_dims(values, 2)
    scores = queries @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap)
    scores *= softcap
    scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    if sinks is not None:
        col = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, n_kv_heads, repeats, 1, 1), scores.shape[:-1] + (1,))
        scores = mx.softmax(mx.concatenate([col, scores], axis=-1), precise=True, axis=-1)[..., 1:]
    else:
        scores = mx.softmax(scores, precise=True, axis=-1)
    return (scores @ values).reshape(B, n_heads, L, head_dim)


def numpy_truth(case: PagedCase, *, scale: float, window: int | None, sinks: np.ndarray | None,
                softcap: float | None = None) -> np.ndarray:  # fmt: skip
    """Float64 softmax attention written out in numpy (validates the SDPA truth's sink/window meaning)."""
    q = np.array(case.q.astype(mx.float32)).astype(np.float64)
    _, hq, num_queries, _ = q.shape
    out = np.zeros_like(q)
    for b, n in enumerate(case.lens):
        rep = hq // case.keys[b].shape[0]
        for h in range(hq):
            k, v = case.keys[b][h // rep].astype(np.float64), case.values[b][h // rep].astype(np.float64)
            for i in range(num_queries):
                pos = n - num_queries + i
                s = q[b, h, i] @ k.T * scale
                if softcap is not None:
                    s = np.tanh(s / softcap) * softcap
                ok = (np.arange(n) <= pos) & ((np.arange(n) > pos - window) if window else True)
                s = np.where(ok, s, -np.inf)
                top = max(s.max(), sinks[h] if sinks is not None else -np.inf)
                w = np.exp(s - top)
                denom = w.sum() + (np.exp(sinks[h] - top) if sinks is not None else 0.0)
                out[b, h, i] = w @ v / denom
    return out
