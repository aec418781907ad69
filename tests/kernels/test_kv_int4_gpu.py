"""The int4 KV cache's Metal/CUDA attention kernels without a GPU: the shared body run by the g++ thread emulator
against the pure-mx reference (which dequantizes as it gathers), its variants recorded from the launch code,
compiled by nvcc and type-checked against the Metal stand-in, and the start-up self-check deciding on them (a
planted body reading the nibbles the wrong way round falls back).

None of this ran on a GPU: the same text is what Metal and CUDA compile, the arithmetic is checked here.
"""

from __future__ import annotations

import dataclasses
import importlib
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
from trillm.kernels.backend import Kernel
from trillm.kernels.kv_write import dequantize_int4, quantize_int4
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import KERNELS, OP, launch_plan, paged_attention_kernel, paged_attention_ref
from trillm.kernels.selfcheck import CACHE_ENV, KernelFallbackWarning, select_kernels
from trillm.kernels.tools.variants import Variant, record

pa = importlib.import_module("trillm.kernels.paged_attention")  # the module (the package exports the function)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator and the stand-in need g++")
EMU = kernel_emulator.BACKEND
LONG = 517  # past 8 partitions of the decode split policy's 64-token minimum
INT4_SHAPES = (
    ModelShapes(9, 3, 64, 16, mx.float32, chunk=64, max_batch=9, kv_dtype="int4"),
    ModelShapes(16, 4, 128, 32, mx.float16, window=128, sinks=True, softcap=30.0, chunk=64, max_batch=9,
                kv_dtype="int4"),
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _emulator() -> None:
    kernel_emulator.install()


def int4_pools(k_pool: mx.array, v_pool: mx.array, seed: int) -> dict[str, mx.array]:
    """Float pools with an offset and a scale per group of 32 (so every group's (scale, min) differs), quantized."""
    shape = (*k_pool.shape[:3], k_pool.shape[3] // 32, 1)
    k, v = (p.astype(mx.float32).reshape(*shape[:4], 32) for p in (k_pool, v_pool))
    f = [mx.exp(mx.random.normal(shape, key=mx.random.key(seed + i))) for i in range(4)]
    (kq, ks), (vq, vs) = (quantize_int4((x * a + b - 0.5).reshape(k_pool.shape))
                          for x, a, b in ((k, f[0], f[1]), (v, f[2], f[3])))  # fmt: skip
    return {"k_pool": kq, "v_pool": vq, "k_scale": ks, "v_scale": vs}


# (lens, L, bs, rep, d, window, with_sinks, dtype, split, softcap); d = 32 puts two lanes on one byte, d = 96 three
# values a lane across a group boundary (lane 10: values 30, 31, 32).
CASES = [
    pytest.param([16, 17, 40, 1], 1, 16, 3, 64, None, False, mx.float32, False, None, id="decode-gqa3-ragged"),
    pytest.param([LONG, 32, 33], 1, 32, 4, 128, 37, True, mx.float32, True, None, id="decode-splitk-window-sinks"),
    pytest.param([LONG], 1, 16, 2, 32, None, False, mx.float32, True, None, id="decode-splitk-d32"),
    pytest.param([16, 17, 23], 5, 16, 1, 96, 7, True, mx.float32, False, None, id="prefill-d96-window-sinks"),
    pytest.param([33, 20], 4, 16, 2, 64, None, False, mx.float16, False, None, id="prefill-f16"),
    pytest.param([LONG, 32], 1, 32, 2, 64, 37, True, mx.float16, True, 2.0, id="decode-f16-splitk-softcap"),
]


@needs_gxx
@pytest.mark.parametrize("lens, num_queries, bs, rep, d, window, with_sinks, dtype, split, softcap", CASES)
def test_int4_attention_body_matches_the_reference(lens, num_queries, bs, rep, d, window, with_sinks, dtype, split,  # type: ignore[no-untyped-def]
                                                   softcap) -> None:  # fmt: skip
    case = make_case(lens, bs=bs, hkv=2, rep=rep, d=d, num_queries=num_queries, dtype=dtype)
    hq = case.q.shape[1]
    plan = launch_plan(EMU, len(lens), hq, hq // rep, num_queries, d, case.block_tables.shape[1] * bs)
    assert (plan.num_parts > 1) == split  # the split cases run the int4 partial kernel and the reduction
    pools = int4_pools(case.k_pool, case.v_pool, seed=len(lens) + d)
    sinks = mx.array(np.linspace(-1.0, 1.5, hq, dtype=np.float32)) if with_sinks else None
    kw: dict[str, Any] = {"scale": d**-0.5 if softcap is None else 0.3, "window": window, "sinks": sinks,
                          "softcap": softcap, "k_scale": pools["k_scale"], "v_scale": pools["v_scale"]}  # fmt: skip
    args = (case.q, pools["k_pool"], pools["v_pool"], case.block_tables, case.context_lens)
    got = paged_attention_kernel(EMU, *args, **kw)
    want = paged_attention_ref(*args, **kw)
    assert got.dtype == want.dtype == dtype
    tol = 2e-5 if dtype == mx.float32 else 4e-3
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol, rtol=tol)
    # The nibble order and the minimum matter: the values read high nibble first are far off.
    packed = pools["v_pool"]
    wrong = paged_attention_ref(case.q, pools["k_pool"], (packed >> 4) | (packed << 4), case.block_tables,
                                case.context_lens, **kw)  # fmt: skip
    assert not np.allclose(np.array(wrong.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=0.05)


@needs_gxx
def test_int4_attention_body_over_what_the_write_stored() -> None:
    """Dense K/V quantized as kv_write_int4 stores them: the kernel's output is attention over exactly the
    dequantized values (the reference's gather is not the truth here: mx.fast SDPA over dense values is)."""
    bs, hkv, d, rep, lens = 16, 2, 64, 3, [40, 7]
    case = make_case(lens, bs=bs, hkv=hkv, rep=rep, d=d, num_queries=1, dtype=mx.float32, seed=5)
    pools = int4_pools(case.k_pool, case.v_pool, seed=11)
    got = paged_attention_kernel(EMU, case.q, pools["k_pool"], pools["v_pool"], case.block_tables,
                                 case.context_lens, scale=0.125, k_scale=pools["k_scale"], v_scale=pools["v_scale"])
    keys = dequantize_int4(pools["k_pool"], pools["k_scale"])
    values = dequantize_int4(pools["v_pool"], pools["v_scale"])
    for b, n in enumerate(lens):
        table = np.array(case.block_tables[b])
        slots = mx.array([int(table[p // bs]) * bs + p % bs for p in range(n)])
        k = keys.reshape(-1, hkv, d)[slots].transpose(1, 0, 2)[None]
        v = values.reshape(-1, hkv, d)[slots].transpose(1, 0, 2)[None]
        want = mx.fast.scaled_dot_product_attention(case.q[b : b + 1], k, v, scale=0.125)
        np.testing.assert_allclose(np.array(got[b : b + 1]), np.array(want), atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- the self-check on the emulated body
@pytest.fixture
def _cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)


SMALL = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=4, chunk=8, max_context=160, kv_dtype="int4")


@needs_gxx
def test_selfcheck_passes_the_emulated_int4_body_and_sets_a_swapped_one_aside(
        _cache: None, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The emulated GPU body plugged in as this back-end's kernel: every int4 check case passes (the decision
    then is the timing's: the emulator is slow); a body reading the high nibble first fails and falls back."""
    monkeypatch.setitem(KERNELS, "cpu", Kernel(partial(paged_attention_kernel, EMU)))
    report = select_kernels(SMALL, ops=[OP], timing_iters=1).report
    for r in report.ops:
        assert not r.failed and r.reason.startswith("checked"), r
    for name in ("ATTN_FINAL_INT4", "ATTN_PARTIAL_INT4"):
        spec = getattr(pa, name)
        monkeypatch.setattr(pa, name, dataclasses.replace(spec, body=spec.body.replace("(v & 1) * 4", "(~v & 1) * 4")))
    with pytest.warns(KernelFallbackWarning, match="paged_attention"):
        sel = select_kernels(dataclasses.replace(SMALL, chunk=9), ops=[OP], timing_iters=1)  # uncached
    assert all(r.failed and r.implementation == "reference" for r in sel.report.ops), sel.report.ops


# ---------------------------------------------------------------- recorded variants, compiled
def test_int4_shapes_launch_the_int4_variants_only() -> None:
    variants = record("metal", INT4_SHAPES)
    names = {v.spec.name for v in variants}
    assert {"paged_attn_final_int4", "paged_attn_partial_int4", "paged_attn_reduce"} <= names
    assert not any(n.startswith("paged_attn") and n.endswith(("_final", "_partial", "_int8")) for n in names)
    for v in variants:
        if v.spec.name.startswith("paged_attn") and v.spec.name.endswith("_int4"):
            assert v.input_dtypes[1:5] == (mx.uint8, mx.uint8, mx.float32, mx.float32)  # pools, then their scales
            assert v.input_dtypes[0] in (mx.float32, mx.float16) and not any(v.constant_inputs)


def _int4_variants(target: str) -> list[Variant]:
    # the reduction and the gathers: the float variants' own
    return distinct_variants(target, INT4_SHAPES, lambda v: v.spec.name.endswith("_int4"))


@needs_gxx
def test_int4_metal_variants_type_check_against_the_standin() -> None:
    assert_metal_standin_accepts(_int4_variants("metal"))


def test_int4_cuda_variants_compile() -> None:
    assert_nvcc_compiles(_int4_variants("cuda"))
