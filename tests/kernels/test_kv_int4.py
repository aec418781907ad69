"""The int4 KV cache: 4-bit quantize-on-write (two values a byte, (scale, min) per group of 32 along
head_dim), the paged attention reference over such pools, which dequantizes as it gathers, and the CPU
primitive's int4 variant, which decodes each token's nibbles as it reads them.

quantize_int4 against the grid it promises (within half a step of each group's own range); kv_write_int4
against a dense round trip; the reference against attention over the dequantized values; the CPU primitive
against the reference (decode, partitions, prefill chunks, windows, sinks, soft-capping, ragged rows, every
query dtype); the start-up self-check on int4 shapes (it checks the variant, and a kernel that drops the
minimum falls back). The Metal/CUDA int4 variants: tests/kernels/test_kv_int4_gpu.py.
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
from trillm.kernels.kv_write import INT4_GROUP, dequantize_int4, kv_write_int4, quantize_int4
from trillm.kernels.layout import ModelShapes, random_batch
from trillm.kernels.paged_attention import KERNELS, OP, TOLERANCES, cpu_supports, paged_attention
from trillm.kernels.paged_attention import paged_attention_cpu, paged_attention_ref
from trillm.kernels.selfcheck import CACHE_ENV, KernelFallbackWarning, select_kernels

needs_ext = pytest.mark.skipif(
    os.environ.get(cpu_ext.DISABLE_ENV, "").lower() in ("0", "off", "false", "no") or cpu_ext.load() is None,
    reason="the CPU extension is off or unavailable",
)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)


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


def test_scales_must_match_int4_pools() -> None:
    b = random_batch(ModelShapes(4, 2, 64, 16, mx.float32, kv_dtype="int4"), [20], 1)
    args = (b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens)
    with pytest.raises(ValueError, match="int4 KV pool needs k_scale"):
        paged_attention_ref(*args, scale=1.0)
    assert b.v_scale is not None
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention_ref(*args, scale=1.0, k_scale=b.k_scale, v_scale=b.v_scale[..., 0])




def test_check_cases_carry_int4_pools_and_their_scales() -> None:
    cases = OP.check_cases(ModelShapes(4, 2, 64, 16, mx.float32, kv_dtype="int4", max_context=256, chunk=8))
    assert cases and all(c.args[1].dtype == mx.uint8 and c.kwargs["k_scale"].shape == (*c.args[1].shape[:3], 2, 2)
                         for c in cases)  # fmt: skip


# (queries' dtype, head_dim): groups of 32 at 64 and 128 (whole vector pairs on every ISA); groups of 40 at 80
# and one of 16 at 16 (the scalar decode; 16 is a vector pair on AVX2 and NEON).
KERNEL_CASES = [
    (mx.float32, 64), (mx.float16, 64), (mx.bfloat16, 64), (mx.float32, 128), (mx.float32, 80), (mx.float32, 16),
]  # fmt: skip


@needs_ext
@pytest.mark.parametrize(("dtype", "head_dim"), KERNEL_CASES,
                         ids=[f"{str(t).rsplit('.')[-1]}-D{d}" for t, d in KERNEL_CASES])  # fmt: skip
@pytest.mark.parametrize(("num_queries", "lens", "window", "softcap"), [
    (1, [1, 16, 17, 1029], None, None),  # decode, ragged, one row split into partitions
    (1, [40, 300], 33, 30.0),  # decode in a sliding window, soft-capped
    (5, [5, 21, 300], None, None),  # a prefill chunk over a cached prefix
    (7, [7, 50], 20, 30.0),  # a prefill chunk in a window, soft-capped
], ids=["decode", "decode-window-softcap", "prefill", "prefill-window-softcap"])  # fmt: skip
def test_cpu_kernel_matches_the_reference(dtype: mx.Dtype, head_dim: int, num_queries: int, lens: list[int],
                                          window: int | None, softcap: float | None) -> None:  # fmt: skip
    shapes = ModelShapes(9, 3, head_dim, 16, dtype, sinks=True, kv_dtype="int4")
    assert cpu_supports(shapes) is None
    batch = random_batch(shapes, lens, num_queries, seed=len(lens) + head_dim)
    sinks = mx.random.normal((9,), key=mx.random.key(5))
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables, batch.context_lens)
    kw: dict[str, Any] = {"scale": head_dim**-0.5, "window": window, "sinks": sinks, "softcap": softcap,
                          **batch.scales}  # fmt: skip
    want = paged_attention_ref(*args, **kw)
    got = paged_attention_cpu(*args, **kw)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    atol, rtol = TOLERANCES[dtype]
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=atol, rtol=rtol)
    # The dispatcher takes the kernel for int4 pools, and agrees.
    assert mx.allclose(paged_attention(*args, **kw).astype(mx.float32), want.astype(mx.float32), atol=atol, rtol=rtol)


@needs_ext
def test_cpu_kernel_reads_each_groups_scale_and_minimum() -> None:
    """Planted pools: every K/V value one nibble level, each group's (scale, min) its own; the kernel must
    give attention over exactly those values (a kernel reading one group's pair for all would not)."""
    b = random_batch(ModelShapes(2, 1, 64, 16, mx.float32, kv_dtype="int4"), [20], 1, seed=4)
    assert b.k_scale is not None and b.v_scale is not None
    k_scale = b.k_scale * mx.array([1.0, 3.0]).reshape(1, 1, 1, 2, 1) + mx.array([0.0, 2.0]).reshape(1, 1, 1, 1, 2)
    v_scale = b.v_scale * mx.array([0.5, 2.0]).reshape(1, 1, 1, 2, 1) - mx.array([0.0, 1.0]).reshape(1, 1, 1, 1, 2)
    args = (b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens)
    got = paged_attention_cpu(*args, scale=0.125, k_scale=k_scale, v_scale=v_scale)
    k_f, v_f = dequantize_int4(b.k_pool, k_scale), dequantize_int4(b.v_pool, v_scale)
    want = paged_attention_ref(b.q, k_f, v_f, b.block_tables, b.context_lens, scale=0.125)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4)


@needs_ext
def test_cpu_kernel_checks_the_int4_scales() -> None:
    b = random_batch(ModelShapes(4, 2, 64, 16, mx.float32, kv_dtype="int4"), [20], 1)
    assert b.k_scale is not None and b.v_scale is not None
    args = (b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens)
    with pytest.raises(ValueError, match="int4 KV pool needs k_scale"):
        paged_attention_cpu(*args, scale=1.0)
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention_cpu(*args, scale=1.0, k_scale=b.k_scale, v_scale=b.v_scale[..., :1, :])
    # The primitive's own check, past the Python one: groups that do not divide head_dim.
    ext = cpu_ext.require()
    odd = mx.zeros((*b.k_pool.shape[:3], 3, 2), mx.float32)
    with pytest.raises(ValueError, match="int4"):
        ext.paged_attention(*args, scale=1.0, k_scale=odd, v_scale=odd)


@needs_ext
def test_selfcheck_checks_the_int4_variant_and_falls_back_on_a_kernel_dropping_the_minimum(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    shapes = ModelShapes(4, 2, 64, 16, mx.float32, max_batch=4, chunk=8, max_context=256, kv_dtype="int4")
    sel = select_kernels(shapes, ops=[OP])
    assert sel.report.implementation("paged_attention") == "cpu", sel.report.ops[0].reason

    def no_minimum(*args: Any, k_scale: mx.array | None = None, v_scale: mx.array | None = None,
                   **kwargs: Any) -> mx.array:  # fmt: skip
        assert k_scale is not None and v_scale is not None
        keep = mx.array([1.0, 0.0])  # scales kept, minimums zeroed: every value off by its group's min
        return paged_attention_cpu(*args, k_scale=k_scale * keep, v_scale=v_scale * keep, **kwargs)

    monkeypatch.setitem(KERNELS, "cpu", Kernel(no_minimum, KERNELS["cpu"].supports))
    with pytest.warns(KernelFallbackWarning, match="paged_attention"):
        sel = select_kernels(shapes, ops=[OP])
    assert sel.report.implementation("paged_attention") == "reference" and sel.report.ops[0].failed
