"""The int4 KV cache's pure-mx parts: 4-bit quantize-on-write (two values a byte, (scale, min) per group of
32 along head_dim) and the paged attention reference over such pools, which dequantizes as it gathers.

quantize_int4 against the grid it promises (within half a step of each group's own range); kv_write_int4
against a dense round trip; the reference against attention over the dequantized values; the kernels'
refusal (no Metal/CUDA/CPU int4 variant yet: the reference serves it).
"""

from __future__ import annotations

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels.kv_gather import kv_gather_ref
from trillm.kernels.kv_write import INT4_GROUP, dequantize_int4, kv_write_int4, quantize_int4
from trillm.kernels.layout import ModelShapes, random_batch
from trillm.kernels.paged_attention import OP, cpu_supports, gpu_supports, paged_attention, paged_attention_ref
from trillm.kernels.paged_attention import paged_attention_kernel


def test_quantize_is_within_half_a_step_of_each_groups_range() -> None:
    x = mx.random.normal((50, 3, 64), key=mx.random.key(0)) * mx.array([0.01, 1.0, 30.0]).reshape(1, 3, 1)
    x = x + mx.array([0.0] * 63 + [40.0]).reshape(1, 1, 64)  # an outlier channel: only its own group widens
    x = mx.concatenate([x, mx.full((1, 3, 64), 2.5)])  # a constant token: scale 0, exact values back
    packed, sm = quantize_int4(x)
    assert packed.dtype == mx.uint8 and packed.shape == (51, 3, 32)
    assert sm.shape == (51, 3, 64 // INT4_GROUP, 2) and sm.dtype == mx.float32
    back = dequantize_int4(packed, sm)
    step = mx.repeat(sm[..., 0], INT4_GROUP, axis=-1)
    assert bool(mx.all(mx.abs(back - x) <= step * 0.5 + 1e-5 * (1 + mx.abs(x))))
    # Each group's min and max are on the grid: levels 0 and 15 both used.
    q = np.stack([np.array(packed) & 15, np.array(packed) >> 4], -1).reshape(51, 3, 2, 32)
    assert (q[:50].min(-1) == 0).all() and (q[:50].max(-1) == 15).all()
    assert float(mx.max(mx.abs(back[50] - 2.5))) == 0.0
    # The outlier's group only: the other group of the same head keeps its fine step.
    assert float(mx.max(sm[:50, 1, 0, 0])) < 0.2 * float(mx.min(sm[:50, 1, 1, 0]))


def test_nibbles_are_in_element_order() -> None:
    x = mx.array(np.arange(32, dtype=np.float32) % 16).reshape(1, 32)  # min 0, max 15: scale 1, q = x
    packed, _ = quantize_int4(x)
    assert np.array(packed)[0, 0] == 0 | (1 << 4) and np.array(packed)[0, 7] == 14 | (15 << 4)


def test_write_int4_then_gather_reads_back_each_token_quantized() -> None:
    bs, hkv, d, num_blocks = 16, 2, 64, 6
    k_pool = mx.zeros((num_blocks, bs, hkv, d // 2), mx.uint8)
    v_pool = mx.zeros_like(k_pool)
    k_scale = mx.zeros((num_blocks, bs, hkv, d // INT4_GROUP, 2), mx.float32)
    v_scale = mx.zeros_like(k_scale)
    tables = mx.array([[3, 1, 5]], mx.int32)
    n = 40
    keys = mx.random.normal((n, hkv, d), key=mx.random.key(1))
    values = mx.random.normal((n, hkv, d), key=mx.random.key(2)) * 5
    slots = mx.array([int(tables[0, p // bs]) * bs + p % bs for p in range(n)], mx.int32)
    for lo, hi in ((0, 33), (33, 34), (34, 40)):  # a prefill chunk, then decode-sized writes
        k_pool, v_pool, k_scale, v_scale = kv_write_int4(k_pool, v_pool, k_scale, v_scale, keys[lo:hi],
                                                         values[lo:hi], slots[lo:hi])  # fmt: skip
    for pool, sc, dense in ((k_pool, k_scale, keys), (v_pool, v_scale, values)):
        g = kv_gather_ref(sc.reshape(num_blocks, bs, hkv, -1), tables, n).reshape(1, hkv, n, d // INT4_GROUP, 2)
        got = dequantize_int4(kv_gather_ref(pool, tables, n), g)
        assert mx.array_equal(got[0].transpose(1, 0, 2), dequantize_int4(*quantize_int4(dense)))
        assert float(mx.max(mx.abs(got[0].transpose(1, 0, 2) - dense))) > 0  # lossy, not a float pool


@pytest.mark.parametrize("num_queries", [1, 3])
def test_reference_on_int4_pools_is_attention_over_the_dequantized_values(num_queries: int) -> None:
    shapes = ModelShapes(6, 2, 64, 16, mx.float32, kv_dtype="int4")
    batch = random_batch(shapes, [5, 37, 70], num_queries, seed=3)
    assert batch.k_pool.dtype == mx.uint8 and batch.k_scale is not None and batch.v_scale is not None
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables, batch.context_lens)
    got = paged_attention_ref(*args, scale=0.2, **batch.scales)
    k_f, v_f = dequantize_int4(batch.k_pool, batch.k_scale), dequantize_int4(batch.v_pool, batch.v_scale)
    want = paged_attention_ref(batch.q, k_f, v_f, batch.block_tables, batch.context_lens, scale=0.2)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5)
    # The dispatcher serves int4 pools (through the reference: no kernel has a variant yet).
    assert mx.allclose(paged_attention(*args, scale=0.2, **batch.scales), want, atol=1e-5, rtol=1e-5)


def test_scales_must_match_int4_pools() -> None:
    b = random_batch(ModelShapes(4, 2, 64, 16, mx.float32, kv_dtype="int4"), [20], 1)
    args = (b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens)
    with pytest.raises(ValueError, match="int4 KV pool needs k_scale"):
        paged_attention_ref(*args, scale=1.0)
    assert b.v_scale is not None
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention_ref(*args, scale=1.0, k_scale=b.k_scale, v_scale=b.v_scale[..., 0])


def test_kernels_refuse_the_int4_cache() -> None:
    shapes = ModelShapes(4, 2, 64, 16, mx.float16, kv_dtype="int4")
    reason = gpu_supports(shapes)
    assert reason is not None and "int4" in reason
    cpu_reason = cpu_supports(ModelShapes(4, 2, 64, 16, mx.float32, kv_dtype="int4"))
    assert cpu_reason is not None and "int4" in cpu_reason
    b = random_batch(shapes, [20], 1)
    with pytest.raises(NotImplementedError, match="int4"):
        paged_attention_kernel("metal", b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens, scale=1.0,
                               **b.scales)  # fmt: skip


def test_check_cases_carry_int4_pools_and_their_scales() -> None:
    cases = OP.check_cases(ModelShapes(4, 2, 64, 16, mx.float32, kv_dtype="int4", max_context=256, chunk=8))
    assert cases and all(c.args[1].dtype == mx.uint8 and c.kwargs["k_scale"].shape == (*c.args[1].shape[:3], 2, 2)
                         for c in cases)  # fmt: skip
