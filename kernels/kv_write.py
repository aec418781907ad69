"""Writing one step's new K/V into their pool slots: MLX's scatter, in place through buffer donation.

Pool layout: `trillm.kernels.layout`. No custom kernel on any back-end: an `mx.fast` kernel always writes a
freshly allocated output (MLX never aliases a kernel's input), so it would rewrite the whole pool per call,
O(pool) against the scatter's O(T). The update happens in place only when the caller keeps no other
reference to the old pool: rebind it, `k_pool, v_pool = kv_write(k_pool, v_pool, ...)`.
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
    flat = pool.reshape(-1, *pool.shape[2:])
    flat[slot_mapping] = new.astype(pool.dtype) if new.dtype != pool.dtype else new
    return flat.reshape(pool.shape)


kv_write = kv_write_ref  # the op is its reference on every back-end (see above)
