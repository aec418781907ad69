"""Each custom kernel against its reference on the same grid, where a Metal or CUDA back-end exists."""

from __future__ import annotations

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import _attention_kernels as attn
from trillm.kernels import _kv_cache_kernels as kvk
from trillm.kernels._dispatch import kernel_backend
from trillm.kernels.kv_cache import copy_blocks_ref, kv_gather_ref, kv_write_ref
from trillm.kernels.paged_attention import paged_attention_ref
from paged_cases import TOLERANCES, make_case

BACKEND = kernel_backend()
pytestmark = pytest.mark.skipif(
    BACKEND is None,
    reason=f"no Metal or CUDA back-end here (default device {mx.default_device()}, metal="
    f"{mx.metal.is_available()}, cuda={getattr(mx, 'cuda', None) is not None and mx.cuda.is_available()}, "
    "or TRILLM_KERNELS=ref): the kernels cannot run, only the references",
)


def _lens(bs: int, num_queries: int, long: bool) -> list[int]:
    lens = [bs, bs + 1, 2 * bs + 7, 3 * bs, max(1, num_queries)]
    return lens + [attn.PARTITION_SIZE * 2 + 5] if long else lens  # split-K path


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rep", [1, 3, 4, 8])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("window, with_sinks, long", [(None, False, False), (None, False, True), (37, True, True)])
def test_paged_attention_kernel(num_queries, bs, rep, d, dtype, window, with_sinks, long) -> None:  # type: ignore[no-untyped-def]
    case = make_case(_lens(bs, num_queries, long), bs=bs, hkv=2, rep=rep, d=d, num_queries=num_queries, dtype=dtype)
    sinks = mx.array(np.linspace(-1, 1, 2 * rep, dtype=np.float32)) if with_sinks else None
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    want = paged_attention_ref(*args, scale=d**-0.5, window=window, sinks=sinks)
    got = attn.paged_attention_kernel(BACKEND, *args, d**-0.5, window, sinks)
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("bs", [16, 32])
def test_kv_cache_kernels(bs: int, dtype: mx.Dtype) -> None:
    case = make_case([bs, bs + 1, 50], bs=bs, hkv=2, rep=1, d=64, num_queries=1, dtype=dtype)
    for max_len in (1, bs, bs + 1, 50):
        assert mx.array_equal(kvk.kv_gather_kernel(BACKEND, case.k_pool, case.block_tables, max_len),
                              kv_gather_ref(case.k_pool, case.block_tables, max_len))  # fmt: skip
    slots = mx.array([3, bs * 2 + 1, bs * 3], dtype=mx.int32)
    new = mx.random.normal((3, 2, 64)).astype(dtype)
    got = kvk.kv_write_kernel(BACKEND, case.k_pool, case.v_pool, new, -new, slots)
    want = kv_write_ref(mx.array(case.k_pool), mx.array(case.v_pool), new, -new, slots)
    assert all(mx.array_equal(g, w) for g, w in zip(got, want))
    src, dst = mx.array([1, 2], dtype=mx.int32), mx.array([3, 4], dtype=mx.int32)
    assert mx.array_equal(kvk.copy_blocks_kernel(BACKEND, case.k_pool, src, dst),
                          copy_blocks_ref(mx.array(case.k_pool), src, dst))  # fmt: skip
