"""Each custom kernel against its reference on the same grid, where this device's back-end has kernels.

On a Mac (Metal) or an MLX CUDA build with a GPU; skipped on CPU until the CPU extension registers kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from paged_cases import TOLERANCES, make_case
from trillm.kernels.backend import kernel_backend
from trillm.kernels.kv_gather import KERNELS as GATHER_KERNELS
from trillm.kernels.kv_gather import kv_gather_ref
from trillm.kernels.kv_quantize import OP as KV_WRITE_INT8
from trillm.kernels.layout import ModelShapes, random_batch
from trillm.kernels.paged_attention import KERNELS as ATTENTION_KERNELS
from trillm.kernels.paged_attention import TOLERANCES as SELFCHECK_TOLERANCES
from trillm.kernels.paged_attention import paged_attention_ref

BACKEND = kernel_backend()
ATTENTION = ATTENTION_KERNELS.get(BACKEND or "")
GATHER = GATHER_KERNELS.get(BACKEND or "")
pytestmark = pytest.mark.skipif(
    ATTENTION is None,
    reason=f"no kernels on back-end {BACKEND} (default device {mx.default_device()}, metal="
    f"{mx.metal.is_available()}, cuda={getattr(mx, 'cuda', None) is not None and mx.cuda.is_available()}, "
    "or TRILLM_KERNELS=ref): only the references run here",
)


def _lens(bs: int, num_queries: int, long: bool) -> list[int]:
    lens = [bs, bs + 1, 2 * bs + 7, 3 * bs, max(1, num_queries)]
    return lens + [2 * 512 + 5] if long else lens  # split-K path


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rep", [1, 3, 4, 8])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("window, with_sinks, long, softcap", [
    (None, False, False, None), (None, False, True, None), (37, True, True, None), (37, True, True, 2.0),
])  # fmt: skip
def test_paged_attention_kernel(num_queries, bs, rep, d, dtype, window, with_sinks, long, softcap) -> None:  # type: ignore[no-untyped-def]
    assert ATTENTION is not None
    case = make_case(_lens(bs, num_queries, long), bs=bs, hkv=2, rep=rep, d=d, num_queries=num_queries, dtype=dtype)
    sinks = mx.array(np.linspace(-1, 1, 2 * rep, dtype=np.float32)) if with_sinks else None
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    scale = d**-0.5 if softcap is None else 0.3  # larger scores, so the cap bends them
    want = paged_attention_ref(*args, scale=scale, window=window, sinks=sinks, softcap=softcap)
    got = ATTENTION.fn(*args, scale=scale, window=window, sinks=sinks, softcap=softcap)
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("rep", [1, 4])
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("window, with_sinks, softcap", [(None, False, None), (37, True, 2.0)])
@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_paged_attention_kernel_quantized_cache(num_queries: int, rep: int, dtype: mx.Dtype, window: int | None,
                                                with_sinks: bool, softcap: float | None, kv: str) -> None:  # fmt: skip
    """The int8 KV cache (int8 pools, a float32 scale per token and KV head) and the int4 one (two values a byte,
    (scale, min) per group of 32), short rows and one that splits."""
    assert ATTENTION is not None
    shapes = ModelShapes(2 * rep, 2, 64, 16, dtype, kv_dtype=kv)
    if (why := ATTENTION.supports(shapes)) is not None:
        pytest.skip(f"no {kv} variant on {BACKEND}: {why}")
    batch = random_batch(shapes, _lens(16, num_queries, True), num_queries, seed=rep + num_queries)
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables, batch.context_lens)
    sinks = mx.array(np.linspace(-1, 1, 2 * rep, dtype=np.float32)) if with_sinks else None
    kw: dict[str, Any] = {"scale": 0.125 if softcap is None else 0.3, "window": window, "sinks": sinks,
                          "softcap": softcap, **batch.scales}  # fmt: skip
    want = paged_attention_ref(*args, **kw)
    got = ATTENTION.fn(*args, **kw)
    atol, rtol = SELFCHECK_TOLERANCES[dtype]  # the reference dequantizes into q's dtype, the kernels to float32
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_kv_write_int8_kernel(dtype: mx.Dtype) -> None:
    """Quantize-on-write: all four pools exactly as the reference writes them (ties, zero rows included)."""
    kernel = KV_WRITE_INT8.kernels.get(BACKEND or "")
    shapes = ModelShapes(6, 3, 64, 16, dtype, chunk=70, kv_dtype="int8")
    if kernel is None or kernel.supports(shapes) is not None:
        pytest.skip(f"no kv_write_int8 kernel on {BACKEND} (the CPU runs the reference)")
    for case in KV_WRITE_INT8.check_cases(shapes):
        for g, w in zip(kernel.fn(*case.args), KV_WRITE_INT8.reference(*case.args)):
            assert mx.array_equal(g, w), case.label


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("bs", [16, 32])
def test_kv_gather_kernel(bs: int, dtype: mx.Dtype) -> None:
    if GATHER is None:
        pytest.skip(f"no kv_gather kernel on {BACKEND}")
    case = make_case([bs, bs + 1, 50], bs=bs, hkv=2, rep=1, d=64, num_queries=1, dtype=dtype)
    for max_len in (1, bs, bs + 1, 50):
        assert mx.array_equal(GATHER.fn(case.k_pool, case.block_tables, max_len),
                              kv_gather_ref(case.k_pool, case.block_tables, max_len))  # fmt: skip


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("heads, r, p", [(16, 512, 64), (4, 64, 32)])
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("long", [False, True])
def test_mla_attention_kernel(num_queries: int, heads: int, r: int, p: int, dtype: mx.Dtype, long: bool) -> None:
    from trillm.kernels.layout import ModelShapes
    from trillm.kernels.mla_attention import KERNELS as MLA_KERNELS
    from trillm.kernels.mla_attention import mla_attention_ref, random_mla_batch

    shapes = ModelShapes(heads, 1, r, 16, dtype, kv_lora_rank=r, qk_rope_head_dim=p)
    kernel = MLA_KERNELS.get(BACKEND or "")
    if kernel is None or kernel.supports(shapes) is not None:
        pytest.skip(f"no MLA kernel on {BACKEND} for these shapes")
    lens = [max(n, num_queries) for n in (16, 17, 39, 1)] + ([2 * 512 + 5] if long else [])
    batch = random_mla_batch(shapes, lens, num_queries, seed=heads)
    scale = (r + p) ** -0.5
    want = mla_attention_ref(*batch.args, scale=scale)
    got = kernel.fn(*batch.args, scale=scale)
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol, rtol=rtol)
