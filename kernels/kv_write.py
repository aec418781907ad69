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


kv_write_int8 = kv_write_int8_ref  # Metal/CUDA also quantize in one kernel launch: trillm.kernels.kv_quantize


# ---------------------------------------------------------------- the int4 cache
# `--kv-cache-dtype int4`: the pools hold two 4-bit values per byte, uint8 [num_blocks, block_size, Hkv, D / 2]
# (element 2i in the low nibble of byte i, 2i + 1 in the high one), and beside each a float32 scale pool
#     k_scale, v_scale: [num_blocks, block_size, num_kv_heads, D / INT4_GROUP, 2]
# holding (scale, minimum) per group of INT4_GROUP values along head_dim: asymmetric, value = q * scale + min,
# q in 0..15. Per token as int8 (known at the write, read with the row); per group of 32 and with a zero
# point because 16 levels over a whole head's range lose too much (docs/performance.md: SmolLM2's K rows
# carry outlier channels that a per-head scale spends most levels on).
INT4_GROUP = 32
INT4_LEVELS = 15.0


def int4_groups(head_dim: int) -> int:
    """Scale groups per head: head_dim / INT4_GROUP, or one group when head_dim is smaller."""
    return max(1, head_dim // INT4_GROUP)


def quantize_int4(x: mx.array) -> tuple[mx.array, mx.array]:
    """Asymmetric 4-bit per group over the last axis: x [..., D] -> (uint8 [..., D / 2] packed, float32
    [..., G, 2] (scale, min)), x ~ q * scale + min. A constant group gets scale 0 (its values come back
    exactly as the min)."""
    *lead, d = x.shape
    g = int4_groups(d)
    xf = (x if x.dtype == mx.float32 else x.astype(mx.float32)).reshape(*lead, g, d // g)
    lo, hi = mx.min(xf, axis=-1), mx.max(xf, axis=-1)
    scale = (hi - lo) * (1.0 / INT4_LEVELS)
    q = mx.round((xf - lo[..., None]) * (INT4_LEVELS / mx.maximum(hi - lo, 1e-30))[..., None])
    q = mx.clip(q, 0, INT4_LEVELS).astype(mx.uint8).reshape(*lead, d // 2, 2)
    packed = q[..., 0] | (q[..., 1] << 4)
    return packed, mx.stack([scale, lo], axis=-1)


def dequantize_int4(packed: mx.array, scale: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """packed uint8 [..., D / 2] with (scale, min) [..., G, 2] -> [..., D] in `dtype` (computed in float32)."""
    *lead, half = packed.shape
    g = scale.shape[-2]
    q = mx.stack([packed & 15, packed >> 4], axis=-1).astype(mx.float32).reshape(*lead, g, 2 * half // g)
    return (q * scale[..., 0:1] + scale[..., 1:2]).reshape(*lead, 2 * half).astype(dtype)


def kv_write_int4_ref(
    k_pool: mx.array, v_pool: mx.array, k_scale: mx.array, v_scale: mx.array, keys: mx.array, values: mx.array,
    slot_mapping: mx.array,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:  # fmt: skip
    """Quantize new K/V to 4 bits per group, scatter them and their (scale, min); returns the four pools.

    Shapes: k_pool, v_pool uint8 [num_blocks, block_size, Hkv, D / 2]; k_scale, v_scale float32
    [num_blocks, block_size, Hkv, G, 2]; keys, values [T, Hkv, D]; slot_mapping int32 [T]. In place as kv_write.
    """
    qk, sk = quantize_int4(keys)
    qv, sv = quantize_int4(values)
    return (_scatter(k_pool, qk, slot_mapping), _scatter(v_pool, qv, slot_mapping),
            _scatter(k_scale, sk, slot_mapping), _scatter(v_scale, sv, slot_mapping))


kv_write_int4 = kv_write_int4_ref  # MLX's scatter on every back-end, as kv_write
