"""The int8 KV cache's kernels: quantize-on-write, and paged attention that dequantizes as it reads.

kv_write_int8 against a dense round trip; the CPU primitive against `paged_attention_ref` on int8 pools
(and float16/bfloat16 pools under float32 queries); the reference against attention over the dequantized
values written out by hand; the start-up self-check on int8 shapes (it checks the int8 variant, and a kernel
that ignores the scales falls back); and what the Metal/CUDA kernels take (their int8 bodies run emulated in
test_kv_int8_gpu.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import Kernel
from trillm.kernels.kv_gather import kv_gather_ref
from trillm.kernels.kv_write import INT8_MAX, dequantize_int8, kv_write_int8, quantize_int8
from trillm.kernels.layout import ModelShapes, random_batch
from trillm.kernels.paged_attention import KERNELS, OP, TOLERANCES, gpu_supports, paged_attention, paged_attention_ref
from trillm.kernels.paged_attention import paged_attention_cpu, paged_attention_kernel
from trillm.kernels.selfcheck import CACHE_ENV, KernelFallbackWarning, select_kernels

needs_ext = pytest.mark.skipif(
    os.environ.get(cpu_ext.DISABLE_ENV, "").lower() in ("0", "off", "false", "no") or cpu_ext.load() is None,
    reason="the CPU extension is off or unavailable",
)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)


def test_quantize_is_within_half_a_step_per_token_and_head() -> None:
    x = mx.random.normal((50, 3, 64), key=mx.random.key(0)) * mx.array([0.01, 1.0, 30.0]).reshape(1, 3, 1)
    x = mx.concatenate([x, mx.zeros((1, 3, 64))])  # an all-zero token: scale 0, exact zeros back
    q, scale = quantize_int8(x)
    assert q.dtype == mx.int8 and scale.shape == (51, 3) and scale.dtype == mx.float32
    err = mx.abs(dequantize_int8(q, scale) - x)
    assert bool(mx.all(err <= scale[..., None] * 0.5 + 1e-7))
    # The scale is each token and head's own absmax / 127: the largest value maps to +-127 exactly.
    assert np.allclose(np.array(mx.max(mx.abs(q.astype(mx.int32)), axis=-1))[:50], INT8_MAX)
    assert float(mx.max(mx.abs(dequantize_int8(q, scale)[50]))) == 0.0


def test_write_int8_then_gather_reads_back_each_token_quantized() -> None:
    bs, hkv, d, num_blocks = 16, 2, 32, 6
    k_pool = mx.zeros((num_blocks, bs, hkv, d), mx.int8)
    v_pool = mx.zeros_like(k_pool)
    k_scale = mx.zeros((num_blocks, bs, hkv), mx.float32)
    v_scale = mx.zeros_like(k_scale)
    tables = mx.array([[3, 1, 5]], mx.int32)
    n = 40
    keys = mx.random.normal((n, hkv, d), key=mx.random.key(1))
    values = mx.random.normal((n, hkv, d), key=mx.random.key(2)) * 5
    slots = mx.array([int(tables[0, p // bs]) * bs + p % bs for p in range(n)], mx.int32)
    for lo, hi in ((0, 33), (33, 34), (34, 40)):  # a prefill chunk, then decode-sized writes
        k_pool, v_pool, k_scale, v_scale = kv_write_int8(k_pool, v_pool, k_scale, v_scale, keys[lo:hi],
                                                         values[lo:hi], slots[lo:hi])  # fmt: skip
    for pool, sc, dense in ((k_pool, k_scale, keys), (v_pool, v_scale, values)):
        got = dequantize_int8(kv_gather_ref(pool, tables, n), kv_gather_ref(sc[..., None], tables, n)[..., 0])
        qd, sd = quantize_int8(dense)
        assert mx.array_equal(got[0].transpose(1, 0, 2), dequantize_int8(qd, sd))


def test_reference_on_int8_pools_is_attention_over_the_dequantized_values() -> None:
    shapes = ModelShapes(6, 2, 32, 16, mx.float32, kv_dtype="int8")
    batch = random_batch(shapes, [5, 37, 70], 3, seed=3)
    assert batch.k_scale is not None and batch.v_scale is not None
    got = paged_attention_ref(batch.q, batch.k_pool, batch.v_pool, batch.block_tables, batch.context_lens,
                              scale=0.2, **batch.scales)  # fmt: skip
    k_f, v_f = dequantize_int8(batch.k_pool, batch.k_scale), dequantize_int8(batch.v_pool, batch.v_scale)
    want = paged_attention_ref(batch.q, k_f, v_f, batch.block_tables, batch.context_lens, scale=0.2)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5)


CASES = [  # (queries' dtype, pools' dtype)
    (mx.float32, "int8"), (mx.float16, "int8"), (mx.bfloat16, "int8"), (mx.float32, "float16"),
    (mx.float32, "bfloat16"),
]  # fmt: skip


@needs_ext
@pytest.mark.parametrize(("dtype", "kv_dtype"), CASES, ids=[f"{str(d).rsplit('.')[-1]}-{k}" for d, k in CASES])
@pytest.mark.parametrize(("num_queries", "lens", "window"), [
    (1, [1, 16, 17, 1029], None),  # decode, one row split into partitions
    (1, [40, 300], 33),  # decode in a sliding window
    (5, [5, 21, 300], None),  # a prefill chunk over a cached prefix
], ids=["decode", "decode-window", "prefill"])  # fmt: skip
def test_cpu_kernel_matches_the_reference(dtype: mx.Dtype, kv_dtype: str, num_queries: int, lens: list[int],
                                          window: int | None) -> None:  # fmt: skip
    shapes = ModelShapes(9, 3, 64, 16, dtype, sinks=True, kv_dtype=kv_dtype)
    batch = random_batch(shapes, lens, num_queries, seed=len(lens))
    sinks = mx.random.normal((9,), key=mx.random.key(5))
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables, batch.context_lens)
    kw: dict[str, Any] = {"scale": 0.125, "window": window, "sinks": sinks, **batch.scales}
    want = paged_attention_ref(*args, **kw)
    got = paged_attention_cpu(*args, **kw)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    atol, rtol = TOLERANCES[dtype]
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=atol, rtol=rtol)
    # The dispatcher takes the kernel for these pools too, and agrees.
    assert mx.allclose(paged_attention(*args, **kw).astype(mx.float32), want.astype(mx.float32), atol=atol, rtol=rtol)


@needs_ext
def test_scales_must_come_with_int8_pools_and_only_with_them() -> None:
    shapes = ModelShapes(4, 2, 32, 16, mx.float32, kv_dtype="int8")
    b = random_batch(shapes, [20], 1)
    args = (b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens)
    for fn in (paged_attention_ref, paged_attention_cpu):
        with pytest.raises(ValueError, match="k_scale"):
            fn(*args, scale=1.0)
        with pytest.raises(ValueError, match="v_scale"):
            fn(*args, scale=1.0, k_scale=b.k_scale, v_scale=b.k_scale[:, :, :1])
        f = random_batch(ModelShapes(4, 2, 32, 16, mx.float32), [20], 1)
        with pytest.raises(ValueError, match="int8 pool"):
            fn(f.q, f.k_pool, f.v_pool, f.block_tables, f.context_lens, scale=1.0, **b.scales)


def test_gpu_kernels_take_the_quantized_caches_and_refuse_mixed_floats() -> None:
    """int8 and int4 have Metal/CUDA variants (tests/kernels/test_kv_int8_gpu.py, test_kv_int4_gpu.py run them
    emulated); a float cache of another dtype than the queries' has none."""
    for kv in (None, "int8", "int4"):
        assert gpu_supports(ModelShapes(4, 2, 32, 16, mx.float16, kv_dtype=kv)) is None
    reason = gpu_supports(ModelShapes(4, 2, 32, 16, mx.float16, kv_dtype="float32"))
    assert reason is not None and "float32" in reason
    b = random_batch(ModelShapes(4, 2, 32, 16, mx.float16, kv_dtype="float32"), [20], 1)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention_kernel("metal", b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens, scale=1.0)


def test_check_cases_carry_int8_pools_and_their_scales() -> None:
    cases = OP.check_cases(ModelShapes(4, 2, 32, 16, mx.float32, kv_dtype="int8", max_context=256, chunk=8))
    assert cases and all(c.args[1].dtype == mx.int8 and c.kwargs["k_scale"].shape == c.args[1].shape[:3]
                         for c in cases)  # fmt: skip


@needs_ext
def test_selfcheck_checks_the_int8_variant_and_falls_back_on_a_kernel_ignoring_scales(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    shapes = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=4, chunk=8, max_context=256, kv_dtype="int8")
    sel = select_kernels(shapes, ops=[OP])
    assert sel.report.implementation("paged_attention") == "cpu", sel.report.ops[0].reason

    def unscaled(*args: Any, k_scale: mx.array | None = None, v_scale: mx.array | None = None,
                 **kwargs: Any) -> mx.array:  # fmt: skip
        assert k_scale is not None and v_scale is not None
        ones = mx.ones_like(k_scale) * 0.05  # one scale for every token: wrong wherever a token's differs
        return paged_attention_cpu(*args, k_scale=ones, v_scale=ones, **kwargs)

    monkeypatch.setitem(KERNELS, "cpu", Kernel(unscaled, KERNELS["cpu"].supports))
    with pytest.warns(KernelFallbackWarning, match="paged_attention"):
        sel = select_kernels(shapes, ops=[OP])
    assert sel.report.implementation("paged_attention") == "reference" and sel.report.ops[0].failed
