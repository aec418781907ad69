"""The int8 KV cache's Metal/CUDA kernels without a GPU: the shared bodies run by the g++ thread emulator against
the pure-mx references, their variants recorded from the launch code, compiled by nvcc and type-checked
against the Metal stand-in, and the start-up self-check deciding on them (a planted wrong one falls back).

None of this ran on a GPU: the same text is what Metal and CUDA compile, the arithmetic is checked here.
"""

from __future__ import annotations

import dataclasses
import shutil
from functools import partial
from typing import Any

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

import kernel_emulator
from compiled_variants import assert_metal_standin_accepts, assert_nvcc_compiles, distinct_variants
from paged_cases import make_case
from trillm.kernels import kv_quantize
from trillm.kernels.backend import Kernel
from trillm.kernels.kv_gather import kv_gather_kernel, kv_gather_ref
from trillm.kernels.kv_quantize import OP as KV_WRITE_INT8
from trillm.kernels.kv_quantize import kv_quantize_int8_kernel, kv_write_int8_kernel
from trillm.kernels.kv_write import kv_write_int8_ref, quantize_int8
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import KERNELS, OP, launch_plan, paged_attention_kernel, paged_attention_ref
from trillm.kernels.selfcheck import CACHE_ENV, KernelFallbackWarning, select_kernels
from trillm.kernels.tools.variants import Variant, record

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator and the stand-in need g++")
EMU = kernel_emulator.BACKEND
LONG = 517  # past 8 partitions of the decode split policy's 64-token minimum
INT8_SHAPES = (
    ModelShapes(9, 3, 64, 16, mx.float32, chunk=64, max_batch=9, kv_dtype="int8"),
    ModelShapes(16, 4, 128, 32, mx.float16, window=128, sinks=True, softcap=30.0, chunk=64, max_batch=9,
                kv_dtype="int8"),
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _emulator() -> None:
    kernel_emulator.install()


def int8_pools(k_pool: mx.array, v_pool: mx.array, seed: int) -> dict[str, mx.array]:
    """Float pools times a factor per token and KV head (e^N(0, 1.5): scales far apart), quantized per token and head."""
    shape = k_pool.shape[:3] + (1,)
    kf, vf = (mx.exp(1.5 * mx.random.normal(shape, key=mx.random.key(seed + i))) for i in (0, 1))
    (kq, ks), (vq, vs) = quantize_int8(k_pool.astype(mx.float32) * kf), quantize_int8(v_pool.astype(mx.float32) * vf)
    return {"k_pool": kq, "v_pool": vq, "k_scale": ks, "v_scale": vs}


# (lens, L, bs, rep, d, window, with_sinks, dtype, split, softcap)
CASES = [
    pytest.param([16, 17, 40, 1], 1, 16, 3, 64, None, False, mx.float32, False, None, id="decode-gqa3-ragged"),
    pytest.param([LONG, 32, 33], 1, 32, 4, 128, 37, True, mx.float32, True, None, id="decode-splitk-window-sinks-gqa4"),
    pytest.param([LONG], 1, 16, 2, 32, None, False, mx.float32, True, None, id="decode-splitk-batch1"),
    pytest.param([16, 17, 23], 5, 16, 1, 64, 7, True, mx.float32, False, None, id="prefill-5-queries-window-sinks"),
    pytest.param([LONG, 9], 2, 16, 8, 64, None, True, mx.float32, True, None, id="prefill-long-gqa8-splitk"),
    pytest.param([33, 20], 4, 16, 2, 64, None, False, mx.float16, False, None, id="prefill-f16"),
    pytest.param([LONG, 32], 1, 32, 2, 64, 37, True, mx.float16, True, 2.0, id="decode-f16-splitk-softcap"),
]


@needs_gxx
@pytest.mark.parametrize("lens, num_queries, bs, rep, d, window, with_sinks, dtype, split, softcap", CASES)
def test_int8_attention_body_matches_the_reference(lens, num_queries, bs, rep, d, window, with_sinks, dtype, split,  # type: ignore[no-untyped-def]
                                                   softcap) -> None:  # fmt: skip
    case = make_case(lens, bs=bs, hkv=1 if rep == 8 else 2, rep=rep, d=d, num_queries=num_queries, dtype=dtype)
    hq = case.q.shape[1]
    plan = launch_plan(EMU, len(lens), hq, hq // rep, num_queries, d, case.block_tables.shape[1] * bs)
    assert (plan.num_parts > 1) == split  # the split cases run the int8 partial kernel and the reduction
    pools = int8_pools(case.k_pool, case.v_pool, seed=len(lens) + d)
    sinks = mx.array(np.linspace(-1.0, 1.5, hq, dtype=np.float32)) if with_sinks else None
    kw: dict[str, Any] = {"scale": d**-0.5 if softcap is None else 0.3, "window": window, "sinks": sinks,
                          "softcap": softcap, "k_scale": pools["k_scale"], "v_scale": pools["v_scale"]}  # fmt: skip
    args = (case.q, pools["k_pool"], pools["v_pool"], case.block_tables, case.context_lens)
    got = paged_attention_kernel(EMU, *args, **kw)
    want = paged_attention_ref(*args, **kw)  # dequantizes the table's blocks, then attends as over any pool
    assert got.dtype == want.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 4e-3
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol, rtol=tol)
    # The scales matter: one scale for every token is far off (what a body that skipped them would give).
    flat = {**kw, "k_scale": mx.ones_like(pools["k_scale"]) * 0.05, "v_scale": mx.ones_like(pools["v_scale"]) * 0.05}
    assert not np.allclose(np.array(paged_attention_ref(*args, **flat).astype(mx.float32)),
                           np.array(want.astype(mx.float32)), atol=0.05)  # fmt: skip


@needs_gxx
def test_int8_attention_kernel_checks_its_scales() -> None:
    case = make_case([20], bs=16, hkv=2, rep=2, d=32, num_queries=1, dtype=mx.float32)
    pools = int8_pools(case.k_pool, case.v_pool, seed=1)
    args = (case.q, pools["k_pool"], pools["v_pool"], case.block_tables, case.context_lens)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_kernel(EMU, *args, scale=0.2)
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention_kernel(EMU, *args, scale=0.2, k_scale=pools["k_scale"], v_scale=pools["k_scale"][:, :, :1])


@needs_gxx
def test_gather_body_reads_int8_pools_as_they_lie() -> None:
    """The dense view's gather on the int8 cache's pools (the engine multiplies the gathered scales in)."""
    case = make_case([16, 17, 40], bs=16, hkv=2, rep=1, d=64, num_queries=1, dtype=mx.float32)
    pool = int8_pools(case.k_pool, case.v_pool, seed=3)["k_pool"]
    for max_len in (1, 17, 40):
        assert mx.array_equal(kv_gather_kernel(EMU, pool, case.block_tables, max_len),
                              kv_gather_ref(pool, case.block_tables, max_len))  # fmt: skip


# ---------------------------------------------------------------- quantize on write
@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("hkv, d", [(2, 64), (3, 128), (1, 80)], ids=["gqa-64", "128", "80-partial-lanes"])
def test_quantize_on_write_equals_the_reference_exactly(dtype: mx.Dtype, hkv: int, d: int) -> None:
    """Every check case (decode at B = 1 and 9, prefill chunks, an all-zero token, heads 1e5 apart, untouched
    slots): all four pools equal kv_write_int8_ref's bit for bit."""
    shapes = ModelShapes(hkv * 2, hkv, d, 16, dtype, chunk=70, kv_dtype="int8")
    for case in KV_WRITE_INT8.check_cases(shapes):
        got = kv_write_int8_kernel(EMU, *case.args)
        want = kv_write_int8_ref(*case.args)
        for name, g, w in zip(("k_pool", "v_pool", "k_scale", "v_scale"), got, want):
            assert g.dtype == w.dtype and mx.array_equal(g, w), f"{case.label}: {name}"


@needs_gxx
def test_quantize_rounds_half_to_even_as_mx_round() -> None:
    """Absmax 127 gives a factor of exactly 1, so these values sit on .5 ties: half to even (mx.round, rint), not
    half away from zero (C's round)."""
    row = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5] + [0.0] * 22
    keys = mx.array([[row], [[-x for x in row]]], dtype=mx.float32)  # [T = 2, Hkv = 1, D = 32]
    qk, sk, qv, sv = kv_quantize_int8_kernel(EMU, keys, keys * 0.0)
    want = [127, 0, 2, 2, 0, -2, -2, 4, 126, -126] + [0] * 22
    assert np.array(qk).tolist() == [[want], [[-x for x in want]]]
    assert np.array(sk).tolist() == [[np.float32(127.0) * np.float32(1 / 127)]] * 2
    assert bool(mx.all(qv == 0)) and bool(mx.all(sv == 0))  # all-zero rows: scale 0, zeros back
    ref_q, ref_s = quantize_int8(keys)
    assert mx.array_equal(qk, ref_q) and mx.array_equal(sk, ref_s)


@needs_gxx
def test_written_by_the_kernel_then_attended_by_the_kernel() -> None:
    """As the engine runs: a prefill chunk and decode-sized writes through the quantize kernel, then the int8
    attention kernel over those pools, against the references doing both."""
    bs, hkv, d, rep = 16, 2, 64, 3
    tables = mx.array([[3, 1, 5, 6, 0], [2, 4, 0, 0, 0]], mx.int32)  # block 0: the padding target
    lens = [50, 20]
    keys = mx.random.normal((sum(lens), hkv, d), key=mx.random.key(7)) * 3
    values = mx.random.normal((sum(lens), hkv, d), key=mx.random.key(8))
    slots = mx.array([int(tables[b, p // bs]) * bs + p % bs for b, n in enumerate(lens) for p in range(n)], mx.int32)
    empty = (mx.zeros((8, bs, hkv, d), mx.int8), mx.zeros((8, bs, hkv, d), mx.int8), mx.zeros((8, bs, hkv)),
             mx.zeros((8, bs, hkv)))  # fmt: skip
    pools = {"kernel": empty, "reference": empty}
    for lo, hi in ((0, 45), (45, 50), (50, 69), (69, 70)):
        pools["kernel"] = kv_write_int8_kernel(EMU, *pools["kernel"], keys[lo:hi], values[lo:hi], slots[lo:hi])
        pools["reference"] = kv_write_int8_ref(*pools["reference"], keys[lo:hi], values[lo:hi], slots[lo:hi])
    assert all(mx.array_equal(g, w) for g, w in zip(pools["kernel"], pools["reference"]))
    q = mx.random.normal((2, hkv * rep, 1, d), key=mx.random.key(9))
    k_pool, v_pool, k_scale, v_scale = pools["kernel"]
    ctx = mx.array(lens, mx.int32)
    got = paged_attention_kernel(EMU, q, k_pool, v_pool, tables, ctx, scale=0.125, k_scale=k_scale, v_scale=v_scale)
    k_pool, v_pool, k_scale, v_scale = pools["reference"]
    want = paged_attention_ref(q, k_pool, v_pool, tables, ctx, scale=0.125, k_scale=k_scale, v_scale=v_scale)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the self-check on the emulated bodies
@pytest.fixture
def _cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)


SMALL = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=4, chunk=8, max_context=160, kv_dtype="int8")


@needs_gxx
def test_selfcheck_passes_the_emulated_int8_bodies_and_sets_a_wrong_write_aside(
        _cache: None, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The emulated GPU bodies plugged in as this back-end's kernels: every int8 check case of both ops passes
    (the decision then is the timing's: the emulator is slow); a quantize body rounding half away from zero
    fails the exact comparison and the op falls back, with one warning."""
    monkeypatch.setitem(KERNELS, "cpu", Kernel(partial(paged_attention_kernel, EMU)))
    monkeypatch.setitem(KV_WRITE_INT8.kernels, "cpu", Kernel(partial(kv_write_int8_kernel, EMU)))
    report = select_kernels(SMALL, ops=[OP, KV_WRITE_INT8], timing_iters=1).report
    for r in report.ops:
        assert not r.failed and r.reason.startswith("checked"), r
    plant = dataclasses.replace(kv_quantize.QUANTIZE_INT8,
                                body=kv_quantize.QUANTIZE_INT8.body.replace("RINTF(", "std::round("))  # fmt: skip
    monkeypatch.setattr(kv_quantize, "QUANTIZE_INT8", plant)
    with pytest.warns(KernelFallbackWarning, match="kv_write_int8"):
        sel = select_kernels(dataclasses.replace(SMALL, chunk=9), ops=[KV_WRITE_INT8], timing_iters=1)  # uncached
    assert sel.report.implementation("kv_write_int8") == "reference" and sel.report.ops[0].failed
    assert "exact equality" in sel.report.ops[0].reason and sel.kv_write_int8 is kv_write_int8_ref


# ---------------------------------------------------------------- recorded variants, compiled
def test_int8_shapes_launch_the_int8_variants_only() -> None:
    variants = record("metal", INT8_SHAPES)
    names = {v.spec.name for v in variants}
    assert names == {"paged_attn_final_int8", "paged_attn_partial_int8", "paged_attn_reduce", "kv_gather",
                     "kv_quantize_int8"}  # fmt: skip
    for v in variants:
        if v.spec.name.endswith("_int8") and v.spec.name.startswith("paged_attn"):
            assert v.input_dtypes[1:5] == (mx.int8, mx.int8, mx.float32, mx.float32)  # pools, then their scales
            assert v.input_dtypes[0] in (mx.float32, mx.float16) and not any(v.constant_inputs)
        if v.spec.name == "kv_gather":
            assert v.input_dtypes[0] == mx.int8  # the dense view's gather reads the int8 pool as it lies
    softcapped = {dict(v.template)["HAS_SOFTCAP"] for v in variants if v.spec.name == "paged_attn_partial_int8"}
    assert softcapped == {False, True}


def _int8_variants(target: str) -> list[Variant]:
    # the reduction on CUDA: the float variants' own
    return distinct_variants(target, INT8_SHAPES, lambda v: target == "metal" or v.spec.name != "paged_attn_reduce")


@needs_gxx
def test_int8_metal_variants_type_check_against_the_standin() -> None:
    assert_metal_standin_accepts(_int8_variants("metal"))


def test_int8_cuda_variants_compile() -> None:
    assert_nvcc_compiles(_int8_variants("cuda"))
