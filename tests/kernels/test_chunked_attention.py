"""Chunked attention (Llama 4): a query at position p sees keys k <= p with k // C == p // C.

The truth is independent of the kernels' `lo = p - p % C` bound: dense mx.fast SDPA per row with the mask
built exactly as mlx_lm/models/llama4.py LlamaModel.__call__ builds its chunk_mask. The reference, the CPU
primitive and the shared Metal/CUDA body (run by the g++ emulator: Metal and CUDA cannot run here, so the
emulator and the host compile checks are their check) are each held to it; the self-check's cases cover
the model's chunk and catch a kernel that ignores it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

import kernel_emulator
from paged_cases import TOLERANCES, PagedCase, make_case
from trillm.kernels import cpu_ext
from trillm.kernels.backend import Kernel
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import (
    KERNELS, OP, attention_mask, cpu_supports, launch_plan, paged_attention, paged_attention_cpu,
    paged_attention_kernel, paged_attention_ref,
)  # fmt: skip
from trillm.kernels.selfcheck import check_kernel
from trillm.kernels.tools.variants import record

CPU_OFF = os.environ.get(cpu_ext.DISABLE_ENV, "").lower() in ("0", "off", "false", "no")
EMU = kernel_emulator.BACKEND


def llama4_chunk_mask(n: int, num_queries: int, chunk: int) -> mx.array:
    """mlx-lm's llama4 LlamaModel chunk_mask for a cache holding positions 0..n-1 (its last L new)."""
    offset = n - num_queries
    start, end = 0, offset + num_queries
    linds = mx.arange(start, end)
    rinds = mx.arange(offset, end)[:, None]
    block_pos = mx.abs((linds // chunk) - (rinds // chunk))
    token_pos = linds <= rinds
    return (block_pos == 0) & token_pos


def dense_truth(case: PagedCase, *, scale: float, chunk: int, window: int | None = None,
                sinks: mx.array | None = None) -> mx.array:  # fmt: skip
    """Float32 mx.fast SDPA, one row at a time on its contiguous K/V, under llama4's chunk mask (and a window)."""
    outs = []
    num_queries = case.q.shape[2]
    for b, n in enumerate(case.lens):
        mask = llama4_chunk_mask(n, num_queries, chunk)
        if window is not None:
            pos = mx.arange(n - num_queries, n)[:, None]
            mask = mask & (mx.arange(n) > pos - window)
        outs.append(mx.fast.scaled_dot_product_attention(
            case.q[b : b + 1].astype(mx.float32), mx.array(case.keys[b])[None], mx.array(case.values[b])[None],
            scale=scale, mask=mask, sinks=None if sinks is None else sinks.astype(mx.float32)))
    return mx.concatenate(outs, axis=0)


def _close(got: mx.array, want: mx.array, dtype: mx.Dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol, rtol=rtol)


def _args(case: PagedCase) -> tuple[mx.array, ...]:
    return case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens


def _lens(chunk: int, num_queries: int) -> list[int]:
    """Contexts ending inside the first chunk, at, just past and across chunk boundaries, several chunks on."""
    raw = [1, chunk - 1, chunk, chunk + 1, chunk + num_queries // 2, 3 * chunk + 5, 5 * chunk - 1]
    return [max(n, num_queries) for n in raw]


# (chunk, bs, rep, num_queries): chunks below, equal to, not a multiple of, and spanning blocks; MHA and GQA.
GRID = [
    pytest.param(8, 16, 1, 1, id="decode-chunk8-bs16-mha"),
    pytest.param(12, 16, 4, 1, id="decode-chunk12-bs16-gqa4"),
    pytest.param(16, 16, 2, 1, id="decode-chunk-eq-block"),
    pytest.param(40, 16, 3, 1, id="decode-chunk40-bs16-gqa3"),
    pytest.param(12, 8, 2, 5, id="prefill5-chunk12-bs8"),
    pytest.param(20, 16, 4, 7, id="prefill7-chunk20-bs16-gqa4"),
    pytest.param(8, 16, 1, 19, id="prefill19-crosses-chunks-mha"),
    pytest.param(40, 32, 8, 9, id="prefill9-chunk40-bs32-gqa8"),
]


@pytest.mark.parametrize("chunk, bs, rep, num_queries", GRID)
def test_reference_matches_llama4s_mask(chunk: int, bs: int, rep: int, num_queries: int) -> None:
    case = make_case(_lens(chunk, num_queries), bs=bs, hkv=2, rep=rep, d=32, num_queries=num_queries,
                     dtype=mx.float32, seed=chunk + num_queries)  # fmt: skip
    want = dense_truth(case, scale=32**-0.5, chunk=chunk)
    got = paged_attention_ref(*_args(case), scale=32**-0.5, chunk=chunk)
    _close(got, want, mx.float32)
    # The chunk matters on these contexts: plain causal attention is far off.
    causal = paged_attention_ref(*_args(case), scale=32**-0.5)
    assert float(mx.max(mx.abs(causal - want)).item()) > 0.05


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_mask_is_the_same_aligned_chunk(chunk: int) -> None:
    lens = mx.array([5, 17, 40], dtype=mx.int32)
    got = np.array(attention_mask(lens, 4, 48, None, chunk))
    for b, n in enumerate([5, 17, 40]):
        full = np.zeros((4, 48), bool)
        full[:, :n] = np.array(llama4_chunk_mask(n, 4, chunk))
        assert (got[b, 0] == full).all()


def test_window_and_chunk_both_bound() -> None:
    # Both set: the intersection (the later of the two lower bounds), on the reference and the mask.
    case = make_case([9, 30, 47, 64], bs=16, hkv=2, rep=2, d=32, num_queries=6, dtype=mx.float32, seed=5)
    want = dense_truth(case, scale=0.2, chunk=20, window=7)
    _close(paged_attention_ref(*_args(case), scale=0.2, chunk=20, window=7), want, mx.float32)


@pytest.mark.parametrize("bad", [0, -4])
def test_a_chunk_below_one_is_refused(bad: int) -> None:
    case = make_case([8], bs=16, hkv=1, rep=1, d=32, num_queries=1, dtype=mx.float32)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        paged_attention_ref(*_args(case), scale=1.0, chunk=bad)
    with pytest.raises(ValueError, match="attention_chunk must be >= 1"):
        ModelShapes(4, 2, 32, 16, mx.float32, attention_chunk=bad)


# ---------------------------------------------------------------- the CPU primitive
@pytest.fixture(scope="module")
def ext() -> object:
    if CPU_OFF:
        pytest.skip(f"{cpu_ext.DISABLE_ENV} turns the CPU extension off")
    module = cpu_ext.load()
    assert module is not None, f"the CPU extension did not load: {cpu_ext.status().reason}"
    return module


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [64, 16, 96])  # 64: the unrolled path; 16 (the tiny zoo models') and 96: any-D
@pytest.mark.parametrize("chunk, bs, rep, num_queries", GRID)
def test_cpu_primitive_matches_the_truth(ext: object, chunk: int, bs: int, rep: int, num_queries: int, d: int,
                                         dtype: mx.Dtype) -> None:  # fmt: skip
    case = make_case(_lens(chunk, num_queries), bs=bs, hkv=2, rep=rep, d=d, num_queries=num_queries, dtype=dtype,
                     seed=d + chunk)  # fmt: skip
    got = paged_attention_cpu(*_args(case), scale=d**-0.5, chunk=chunk)
    _close(got, dense_truth(case, scale=d**-0.5, chunk=chunk).astype(dtype), dtype)
    _close(got, paged_attention_ref(*_args(case), scale=d**-0.5, chunk=chunk), dtype)


@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("chunk", [300, 1000, 513])
def test_cpu_primitive_across_partitions(ext: object, num_queries: int, chunk: int) -> None:
    """Contexts past the 512-token partitions: the chunk's lower bound in a later partition than the row's
    start (the earlier partitions then hold nothing), or a chunk that spans a partition boundary."""
    lens = [1029, chunk + 3, 2 * chunk + num_queries // 2, 517]
    case = make_case(lens, bs=16, hkv=2, rep=4, d=64, num_queries=num_queries, dtype=mx.float32, seed=chunk)
    sinks = mx.array(np.linspace(-1.0, 1.0, 8, dtype=np.float32))
    got = paged_attention_cpu(*_args(case), scale=0.125, chunk=chunk, sinks=sinks)
    _close(got, dense_truth(case, scale=0.125, chunk=chunk, sinks=sinks), mx.float32)


def test_cpu_primitive_window_chunk_sinks_softcap(ext: object) -> None:
    case = make_case([9, 30, 47, 64, 600], bs=16, hkv=2, rep=2, d=64, num_queries=6, dtype=mx.float16, seed=9)
    sinks = mx.array(np.linspace(-1.0, 1.0, 4, dtype=np.float32))
    kw = dict(scale=0.2, chunk=20, window=7, sinks=sinks, softcap=3.0)
    _close(paged_attention_cpu(*_args(case), **kw), paged_attention_ref(*_args(case), **kw), mx.float16)  # type: ignore[arg-type]


def test_cpu_primitive_refuses_a_negative_chunk(ext: object) -> None:
    case = make_case([8], bs=16, hkv=1, rep=1, d=32, num_queries=1, dtype=mx.float32)
    with pytest.raises(ValueError, match="chunk"):
        mx.eval(ext.paged_attention(*_args(case), scale=1.0, chunk=-1))  # type: ignore[attr-defined]


def test_dispatcher_passes_the_chunk(ext: object) -> None:
    case = make_case(_lens(12, 3), bs=16, hkv=2, rep=2, d=64, num_queries=3, dtype=mx.float32, seed=1)
    _close(paged_attention(*_args(case), scale=0.125, chunk=12), dense_truth(case, scale=0.125, chunk=12), mx.float32)


# ---------------------------------------------------------------- the self-check's cases
SHAPES = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=4, chunk=8, max_context=256, attention_chunk=20)


def test_check_cases_carry_the_chunk_and_cross_its_boundaries() -> None:
    cases = OP.check_cases(SHAPES)
    assert cases and all(c.kwargs["chunk"] == 20 for c in cases)
    across = [c for c in cases if "across chunks" in c.label]
    assert {c.args[0].shape[2] for c in across} == {1, 3, 8}  # decode, a short and a whole prefill chunk
    longest = max(int(mx.max(c.args[4]).item()) for c in across)
    assert longest > 2 * 20
    assert all(c.kwargs["chunk"] is None for c in OP.check_cases(ModelShapes(4, 2, 32, 16, mx.float32, chunk=8)))


def test_self_check_passes_the_cpu_kernel_and_catches_one_ignoring_the_chunk(ext: object) -> None:
    assert cpu_supports(SHAPES) is None
    assert check_kernel(OP, KERNELS["cpu"], SHAPES) is None

    def chunkless(*args: mx.array, chunk: int | None = None, **kwargs: object) -> mx.array:
        return paged_attention_cpu(*args, **kwargs)  # type: ignore[arg-type]

    failure = check_kernel(OP, Kernel(chunkless, cpu_supports), SHAPES)
    assert failure is not None and "chunk 20" in failure


# ---------------------------------------------------------------- the Metal/CUDA body, emulated and compiled
needs_gpp = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: the kernel emulator needs it")

# (lens, L, bs, rep, d, chunk, window, sinks, dtype, split)
EMULATED = [
    pytest.param([517, 40, 33], 1, 32, 4, 64, 100, None, True, mx.float32, True, id="decode-splitk-chunk100-sinks"),
    pytest.param([16, 29, 61], 7, 16, 2, 32, 12, None, False, mx.float32, False, id="prefill-chunk12-gqa2"),
    pytest.param([517, 23], 3, 16, 8, 64, 37, 9, True, mx.float16, True, id="prefill-splitk-f16-chunk-window-sinks"),
]


@needs_gpp
@pytest.mark.parametrize("lens, num_queries, bs, rep, d, chunk, window, with_sinks, dtype, split", EMULATED)
def test_gpu_body_emulated_matches_the_truth(lens: list[int], num_queries: int, bs: int, rep: int, d: int, chunk: int,
                                             window: int | None, with_sinks: bool, dtype: mx.Dtype,
                                             split: bool) -> None:  # fmt: skip
    kernel_emulator.install()
    case = make_case(lens, bs=bs, hkv=1 if rep == 8 else 2, rep=rep, d=d, num_queries=num_queries, dtype=dtype, seed=d)
    hq = case.q.shape[1]
    plan = launch_plan(EMU, len(lens), hq, hq // rep, num_queries, d, case.block_tables.shape[1] * bs)
    assert (plan.num_parts > 1) == split
    sinks = mx.array(np.linspace(-1.0, 1.5, hq, dtype=np.float32)) if with_sinks else None
    got = paged_attention_kernel(EMU, *_args(case), scale=d**-0.5, chunk=chunk, window=window, sinks=sinks)
    want = dense_truth(case, scale=d**-0.5, chunk=chunk, window=window, sinks=sinks)
    tol = 1e-5 if dtype == mx.float32 else 2e-3
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=tol, rtol=tol)


def test_the_self_check_launches_the_chunk_variant() -> None:
    # The compile checks (test_attention_variants_compile.py: Metal stand-in, nvcc sm_90) cover these shapes.
    chunked = ModelShapes(8, 2, 64, 16, mx.float16, attention_chunk=200, chunk=64, max_batch=9)
    flags = {(v.spec.name, dict(v.template).get("CHUNK")) for v in record("metal", [chunked])}
    assert {("paged_attn_final", 200), ("paged_attn_partial", 200)} <= flags
    plain = {dict(v.template).get("CHUNK") for v in record("metal", [replace(chunked, attention_chunk=None)])}
    assert plain <= {0, None}
