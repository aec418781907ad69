"""KV-cache kernels (shared Metal/CUDA source): gather, write and block copy, one thread per element.

`mx.fast` kernels always write freshly allocated outputs (MLX's CustomKernel never aliases an input), so
a write or copy kernel must rewrite the whole pool: O(pool) per call, against O(T) for MLX's own scatter,
which updates the pool in place through buffer donation. The dispatchers therefore keep the donated
scatter for writes and copies on every back-end (KV_WRITE_USES_KERNEL / COPY_BLOCKS_USES_KERNEL); the
kernels stay as tested, benchmarked sources for a future MLX that lets a kernel donate its input.
"""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels._build import KernelSpec, build
from trillm.kernels._dispatch import Backend

KV_WRITE_USES_KERNEL = False
COPY_BLOCKS_USES_KERNEL = False
_THREADS = 256

# Template: T, BS, HKV, D. meta: [max_blocks, max_len]. One thread per output element.
_GATHER_BODY = """
  const int max_blocks = meta[0];
  const int max_len = meta[1];
  const size_t e = thread_position_in_grid.x;
  const int h = thread_position_in_grid.y;
  const int b = thread_position_in_grid.z;
  if (e < (size_t)max_len * D) {
    const int p = (int)(e / D);
    const int d = (int)(e % D);
    const int blk = block_tables[b * max_blocks + p / BS];
    out[((size_t)(b * HKV + h) * max_len + p) * D + d] = pool[(((size_t)blk * BS + p % BS) * HKV + h) * D + d];
  }
"""

# token_of_slot[s] is the new token written to slot s, or -1. One thread per pool element.
_WRITE_BODY = """
  constexpr int HD = HKV * D;
  const size_t e = thread_position_in_grid.x;
  const size_t n = (size_t)meta[0] * HD;
  if (e < n) {
    const int t = token_of_slot[e / HD];
    const int c = (int)(e % HD);
    k_out[e] = (t >= 0) ? keys[(size_t)t * HD + c] : k_pool[e];
    v_out[e] = (t >= 0) ? values[(size_t)t * HD + c] : v_pool[e];
  }
"""

# src_of_block[blk] is the block copied into blk, or -1. One thread per pool element.
_COPY_BODY = """
  constexpr int BHD = BS * HKV * D;
  const size_t e = thread_position_in_grid.x;
  const size_t n = (size_t)meta[0] * BHD;
  if (e < n) {
    const int src = src_of_block[e / BHD];
    out[e] = (src >= 0) ? pool[(size_t)src * BHD + e % BHD] : pool[e];
  }
"""

GATHER = KernelSpec("kv_gather", ("pool", "block_tables", "meta"), ("out",), _GATHER_BODY)
WRITE = KernelSpec(
    "kv_write", ("k_pool", "v_pool", "keys", "values", "token_of_slot", "meta"), ("k_out", "v_out"), _WRITE_BODY
)
COPY = KernelSpec("copy_blocks", ("pool", "src_of_block", "meta"), ("out",), _COPY_BODY)
SPECS = (GATHER, WRITE, COPY)


def _grid_1d(n: int) -> tuple[int, int, int]:
    return (-(-n // _THREADS) * _THREADS, 1, 1)


def kv_gather_kernel(backend: Backend, pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """Launch the gather kernel. Shapes as `kv_gather_ref`."""
    _, bs, hkv, d = pool.shape
    b, max_blocks = block_tables.shape
    if -(-max_len // bs) > max_blocks:
        raise ValueError(f"max_len {max_len} needs more than the table's {max_blocks} blocks")
    (out,) = build(backend, GATHER)(
        inputs=[pool, block_tables.astype(mx.int32), mx.array([max_blocks, max_len], dtype=mx.int32)],
        template=[("T", pool.dtype), ("BS", bs), ("HKV", hkv), ("D", d)],
        grid=(-(-max_len * d // _THREADS) * _THREADS, hkv, b), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(b, hkv, max_len, d)], output_dtypes=[pool.dtype],
    )  # fmt: skip
    return out


def kv_write_kernel(
    backend: Backend, k_pool: mx.array, v_pool: mx.array, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """Launch the (out-of-place, O(pool)) write kernel. Shapes as `kv_write_ref`."""
    nb, bs, hkv, d = k_pool.shape
    num_slots = nb * bs
    token_of_slot = mx.full((num_slots,), -1, dtype=mx.int32)
    token_of_slot[slot_mapping] = mx.arange(slot_mapping.shape[0], dtype=mx.int32)
    k_out, v_out = build(backend, WRITE)(
        inputs=[k_pool, v_pool, keys.astype(k_pool.dtype), values.astype(v_pool.dtype), token_of_slot,
                mx.array([num_slots], dtype=mx.int32)],
        template=[("T", k_pool.dtype), ("HKV", hkv), ("D", d)],
        grid=_grid_1d(num_slots * hkv * d), threadgroup=(_THREADS, 1, 1),
        output_shapes=[k_pool.shape, v_pool.shape], output_dtypes=[k_pool.dtype, v_pool.dtype],
    )  # fmt: skip
    return k_out, v_out


def copy_blocks_kernel(backend: Backend, pool: mx.array, src_blocks: mx.array, dst_blocks: mx.array) -> mx.array:
    """Launch the (out-of-place, O(pool)) block copy kernel. Shapes as `copy_blocks_ref`."""
    nb, bs, hkv, d = pool.shape
    src_of_block = mx.full((nb,), -1, dtype=mx.int32)
    src_of_block[dst_blocks] = src_blocks.astype(mx.int32)
    (out,) = build(backend, COPY)(
        inputs=[pool, src_of_block, mx.array([nb], dtype=mx.int32)],
        template=[("T", pool.dtype), ("BS", bs), ("HKV", hkv), ("D", d)],
        grid=_grid_1d(pool.size), threadgroup=(_THREADS, 1, 1),
        output_shapes=[pool.shape], output_dtypes=[pool.dtype],
    )  # fmt: skip
    return out
