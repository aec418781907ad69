"""The CPU paged-attention primitive's two bounds: the partition outputs' bytes and the block table's width.

The partial outputs were B x Hq x L x parts x D floats, zero-filled, per layer call (512 MiB for a 512-token
chunk of 32 heads x 128 at 32k); now fewer, longer partitions keep them within MAX_PARTIAL_BYTES. A
context_len beyond the table's width read the next row's table; now the token loop stops at the width.
"""

from __future__ import annotations

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.layout import ModelShapes, random_batch
from trillm.kernels.paged_attention import paged_attention_cpu, paged_attention_ref

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"CPU extension unavailable: {cpu_ext.status().reason}")


@pytest.mark.parametrize("batch, hq, length, d, tokens", [
    (1, 32, 512, 128, 32768), (4, 32, 512, 128, 131072), (64, 32, 8, 128, 32768), (1, 9, 64, 64, 1 << 20),
])  # fmt: skip
def test_the_partial_outputs_stay_within_their_bound(batch: int, hq: int, length: int, d: int, tokens: int) -> None:
    assert ext is not None
    parts, size = ext.attention_partitions(batch, hq, length, d, tokens)
    assert parts * size >= tokens  # every token in some partition
    assert parts == 1 or batch * hq * length * parts * d * 4 <= ext.MAX_PARTIAL_BYTES


def test_decode_keeps_its_partitions() -> None:
    assert ext is not None
    assert ext.attention_partitions(64, 32, 1, 128, 32768) == (32768 // ext.PARTITION_SIZE, ext.PARTITION_SIZE)


def _check(shapes: ModelShapes, lens: list[int], num_queries: int, claimed: list[int] | None = None) -> None:
    batch = random_batch(shapes, lens, num_queries, seed=3)
    context = mx.array(claimed, dtype=mx.int32) if claimed is not None else batch.context_lens
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables, context)
    scale = shapes.head_dim**-0.5
    want = paged_attention_ref(*args, scale=scale)
    got = paged_attention_cpu(*args, scale=scale)
    assert mx.allclose(got, want, atol=2e-4, rtol=2e-4).item(), mx.max(mx.abs(got - want)).item()


def test_a_bounded_split_of_a_prefill_chunk_is_exact() -> None:
    """128 queries x 16 heads x 128 at 40k: 1 MiB a partition, so 64 partitions of 625 tokens, not 79 of 512."""
    assert ext is not None
    shapes = ModelShapes(16, 2, 128, 16, mx.float32)
    n = 40000
    parts, size = ext.attention_partitions(1, 16, 128, 128, -(-n // 16 + 1) * 16)
    assert parts == ext.MAX_PARTIAL_BYTES // (16 * 128 * 128 * 4) and size % ext.PARTITION_SIZE
    _check(shapes, [n], 128)


@pytest.mark.parametrize("num_queries", [1, 5])
def test_a_context_longer_than_the_table_reads_only_the_table(num_queries: int) -> None:
    """Row 0 claims 3 blocks more than its table holds: it must see its own table's tokens, never row 1's."""
    shapes = ModelShapes(4, 2, 32, 16, mx.float32)
    lens = [40, 200]  # row 0's table is as wide as row 1's (the batch's widest) plus a padding column
    batch = random_batch(shapes, lens, num_queries, seed=5)
    width = batch.block_tables.shape[1] * shapes.block_size
    _check(shapes, lens, num_queries, claimed=[width + 3 * shapes.block_size, 200])
