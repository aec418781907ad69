"""Writing one step's new K/V into their pool slots: MLX's scatter, in place through buffer donation.

Pool layout: `trillm.kernels.layout`. No custom kernel on any back-end: an `mx.fast` kernel always writes a
freshly allocated output (MLX never aliases a kernel's input), so it would rewrite the whole pool per call,
O(pool) against the scatter's O(T). The update happens in place only when the caller keeps no other
reference to the old pool: rebind it, `k_pool, v_pool = kv_write(k_pool, v_pool, ...)`.

The int8 cache (`kv_write_int8`, below) quantizes on this write: int8 values and one float32 scale per token
and KV head, scattered the same way.
"""

from __future__ import annotations

import mlx.core as mx


def kv_write_ref(
    k_pool: mx.array, v_pool: mx.array, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V into the pools at `slot_mapping`; returns the updated (k_pool, v_pool).

    Shapes: k_pool, v_pool [num_blocks, block_size, Hkv, D]; keys, values [T, Hkv, D];
    slot_mapping int32 [T] -> (k_pool, v_pool) with the same shapes.
    """
    return _scatter(k_pool, keys, slot_mapping), _scatter(v_pool, values, slot_mapping)


def _scatter(pool: mx.array, new: mx.array, slot_mapping: mx.array) -> mx.array:
    flat = pool.reshape(-1, *pool.shape[2:])  # [slots, Hkv, D] (a scale pool: [slots, Hkv])
    flat[slot_mapping] = new.astype(pool.dtype) if new.dtype != pool.dtype else new
    return flat.reshape(pool.shape)


kv_write = kv_write_ref  # the op is its reference on every back-end (see above)


# ---------------------------------------------------------------- the int8 cache
# `--kv-cache-dtype int8`: the pools hold int8 K/V and, beside each, a float32 scale pool
#     k_scale, v_scale: [num_blocks, block_size, num_kv_heads]
# one scale per token per KV head (absmax / 127, symmetric, no zero point): a token's values are quantized
# once, when it is written, from its own values alone. A per-block scale would have to be known before the
# block's later tokens arrive (or requantize the earlier ones at every write); per token the scale sits in
# the same slot as its row, so the kernels read it with the row, at 4 / head_dim bytes per value (6% at 64).
INT8_MAX = 127.0


def quantize_int8(x: mx.array) -> tuple[mx.array, mx.array]:
    """Symmetric int8 over the last axis: x [..., D] -> (int8 [..., D], float32 scale [...]), x ~ q * scale.

    An all-zero row gets scale 0 (its values dequantize to 0 exactly). Few ops on purpose: every layer runs
    this for K and V at every step, and on CPU an op's dispatch costs more than its arithmetic at decode's T.
    |x * 127 / absmax| <= 127 up to rounding, so no clip is needed; the floor on absmax keeps 0 / 0 out."""
    xf = x if x.dtype == mx.float32 else x.astype(mx.float32)
    amax = mx.max(mx.abs(xf), axis=-1)
    q = mx.round(xf * (INT8_MAX / mx.maximum(amax, 1e-30))[..., None]).astype(mx.int8)
    return q, amax * (1.0 / INT8_MAX)


def dequantize_int8(q: mx.array, scale: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """q int8 [..., D] times scale [...] -> [..., D] in `dtype` (computed in float32)."""
    return (q.astype(mx.float32) * scale[..., None]).astype(dtype)


def kv_write_int8_ref(
    k_pool: mx.array, v_pool: mx.array, k_scale: mx.array, v_scale: mx.array, keys: mx.array, values: mx.array,
    slot_mapping: mx.array,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:  # fmt: skip
    """Quantize new K/V per token and head, scatter them and their scales; returns the four updated pools.

    Shapes: k_pool, v_pool int8 [num_blocks, block_size, Hkv, D]; k_scale, v_scale float32
    [num_blocks, block_size, Hkv]; keys, values [T, Hkv, D] (any float dtype); slot_mapping int32 [T].
    In place when the caller rebinds all four (as `kv_write`).
    """
    qk, sk = quantize_int8(keys)
    qv, sv = quantize_int8(values)
    return (_scatter(k_pool, qk, slot_mapping), _scatter(v_pool, qv, slot_mapping),
            _scatter(k_scale, sk, slot_mapping), _scatter(v_scale, sv, slot_mapping))


kv_write_int8 = kv_write_int8_ref  # MLX's scatter on every back-end, as kv_write
