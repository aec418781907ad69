"""Moving K/V in and out of the paged pool: write (scatter by slot), gather (table -> dense), block copy.

Pool layout: see `trillm.kernels.layout`. Every op returns new arrays (MLX is functional); the write
and copy references update the pool buffer in place through MLX buffer donation, which only happens
when the caller holds no other reference to the old pool: rebind it, `pool = kv_write(pool, ...)`.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels._dispatch import kernel_backend
from trillm.kernels import _kv_cache_kernels as _k


# ---------------------------------------------------------------- references
def kv_write_ref(
    k_pool: mx.array, v_pool: mx.array, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """Scatter one step's new K/V into their pool slots (pure mx, in place via donation).

    Shapes: k_pool, v_pool [num_blocks, block_size, Hkv, D]; keys, values [T, Hkv, D];
    slot_mapping int32 [T] -> (k_pool, v_pool) with the same shapes.
    """
    return _scatter(k_pool, keys, slot_mapping), _scatter(v_pool, values, slot_mapping)


def _scatter(pool: mx.array, new: mx.array, slot_mapping: mx.array) -> mx.array:
    flat = pool.reshape(-1, *pool.shape[2:])
    flat[slot_mapping] = new.astype(pool.dtype) if new.dtype != pool.dtype else new
    return flat.reshape(pool.shape)


def kv_gather_ref(pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """Read rows of the pool through their block tables into dense, head-major K (or V).

    Shapes: pool [num_blocks, bs, Hkv, D]; block_tables int32 [B, max_blocks] -> [B, Hkv, max_len, D].
    Position p of row b is slot block_tables[b, p // bs] * bs + p % bs; positions at/after a row's
    context length hold whatever the table points at (callers mask them).
    """
    bs = pool.shape[1]
    num_blocks = -(-max_len // bs)
    if num_blocks > block_tables.shape[1]:
        raise ValueError(f"max_len {max_len} needs {num_blocks} blocks, block_tables has {block_tables.shape[1]}")
    dense = _gather_blocks(pool, block_tables[:, :num_blocks])  # [B, Hkv, num_blocks * bs, D]
    return dense if num_blocks * bs == max_len else dense[:, :, :max_len]


def _gather_blocks(pool: mx.array, block_tables: mx.array) -> mx.array:
    """[num_blocks, bs, Hkv, D] through [B, n] -> contiguous [B, Hkv, n * bs, D].

    One block-wise gather (whole contiguous blocks) then one explicit head-major copy: on CPU, SDPA on
    the transposed view is ~2x slower than this copy plus SDPA on contiguous K/V (bench_kernels).
    """
    b, n = block_tables.shape
    _, bs, hkv, d = pool.shape
    blocks = pool[block_tables]  # [B, n, bs, Hkv, D]
    return mx.contiguous(blocks.reshape(b, n * bs, hkv, d).transpose(0, 2, 1, 3))


def copy_blocks_ref(pool: mx.array, src_blocks: mx.array, dst_blocks: mx.array) -> mx.array:
    """Copy whole blocks src_blocks[i] -> dst_blocks[i] (copy-on-write of a shared partial block).

    Shapes: pool [num_blocks, bs, Hkv, D]; src_blocks, dst_blocks int32 [N] -> pool's shape.
    dst_blocks must be distinct and disjoint from src_blocks (each copy reads the pre-copy pool).
    """
    pool[dst_blocks] = pool[src_blocks]
    return pool


# ---------------------------------------------------------------- kernels
def kv_write_metal(
    k_pool: mx.array, v_pool: mx.array, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """`kv_write` as a Metal kernel. Shapes as `kv_write_ref`."""
    return _k.kv_write_kernel("metal", k_pool, v_pool, keys, values, slot_mapping)


def kv_write_cuda(
    k_pool: mx.array, v_pool: mx.array, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """`kv_write` as a CUDA kernel. Shapes as `kv_write_ref`."""
    return _k.kv_write_kernel("cuda", k_pool, v_pool, keys, values, slot_mapping)


def kv_gather_metal(pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """`kv_gather` as a Metal kernel. Shapes as `kv_gather_ref`."""
    return _k.kv_gather_kernel("metal", pool, block_tables, max_len)


def kv_gather_cuda(pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """`kv_gather` as a CUDA kernel. Shapes as `kv_gather_ref`."""
    return _k.kv_gather_kernel("cuda", pool, block_tables, max_len)


def copy_blocks_metal(pool: mx.array, src_blocks: mx.array, dst_blocks: mx.array) -> mx.array:
    """`copy_blocks` as a Metal kernel. Shapes as `copy_blocks_ref`."""
    return _k.copy_blocks_kernel("metal", pool, src_blocks, dst_blocks)


def copy_blocks_cuda(pool: mx.array, src_blocks: mx.array, dst_blocks: mx.array) -> mx.array:
    """`copy_blocks` as a CUDA kernel. Shapes as `copy_blocks_ref`."""
    return _k.copy_blocks_kernel("cuda", pool, src_blocks, dst_blocks)


# ---------------------------------------------------------------- dispatchers
def kv_write(
    k_pool: mx.array, v_pool: mx.array, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V into the pools at `slot_mapping`; returns the updated (k_pool, v_pool).

    Shapes: pools [num_blocks, bs, Hkv, D]; keys, values [T, Hkv, D]; slot_mapping int32 [T].
    Rebind the pools to the result and keep no other reference, so the update happens in place.
    """
    backend = kernel_backend()
    if backend is not None and _k.KV_WRITE_USES_KERNEL:
        return _k.kv_write_kernel(backend, k_pool, v_pool, keys, values, slot_mapping)
    return kv_write_ref(k_pool, v_pool, keys, values, slot_mapping)


def kv_gather(pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """Dense K (or V) [B, Hkv, max_len, D] of each row's first max_len positions, read through its table."""
    backend = kernel_backend()
    if backend is None:
        return kv_gather_ref(pool, block_tables, max_len)
    return _k.kv_gather_kernel(backend, pool, block_tables, max_len)


def copy_blocks(pool: mx.array, src_blocks: mx.array, dst_blocks: mx.array) -> mx.array:
    """Copy whole blocks src_blocks[i] -> dst_blocks[i]; returns the updated pool (rebind it)."""
    backend = kernel_backend()
    if backend is not None and _k.COPY_BLOCKS_USES_KERNEL:
        return _k.copy_blocks_kernel(backend, pool, src_blocks, dst_blocks)
    return copy_blocks_ref(pool, src_blocks, dst_blocks)
