"""Kernel sources and wrappers for `kv_cache` (filled in by phase 2)."""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels._dispatch import Backend

KV_WRITE_USES_KERNEL = False
COPY_BLOCKS_USES_KERNEL = False


def kv_write_kernel(
    backend: Backend, k_pool: mx.array, v_pool: mx.array, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    raise NotImplementedError(f"kv_write {backend} kernel")


def kv_gather_kernel(backend: Backend, pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    raise NotImplementedError(f"kv_gather {backend} kernel")


def copy_blocks_kernel(backend: Backend, pool: mx.array, src_blocks: mx.array, dst_blocks: mx.array) -> mx.array:
    raise NotImplementedError(f"copy_blocks {backend} kernel")
