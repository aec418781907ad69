"""Paged MLA attention: the reference against a dense mlx-lm-style computation and against mlx-lm's own
DeepseekV3Attention with its KVCache; the CPU primitive against the reference; the dispatcher and the self-check."""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention, ModelArgs

from paged_cases import TOLERANCES
from trillm.kernels import cpu_ext, selfcheck
from trillm.kernels import mla_attention as mla
from trillm.kernels.backend import Kernel
from trillm.kernels.layout import RESERVED_BLOCK, ModelShapes
from trillm.kernels.mla_attention import mla_attention, mla_attention_cpu, mla_attention_ref, random_mla_batch

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
needs_ext = pytest.mark.skipif(
    os.environ.get(cpu_ext.DISABLE_ENV, "").lower() in ("0", "off", "false", "no"),
    reason=f"{cpu_ext.DISABLE_ENV} turns the CPU extension off",
)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(selfcheck.CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)


def _shapes(dtype: mx.Dtype = mx.float32, heads: int = 4, r: int = 64, p: int = 32, bs: int = 16) -> ModelShapes:
    return ModelShapes(heads, 1, r, bs, dtype, kv_lora_rank=r, qk_rope_head_dim=p, max_batch=4, chunk=8,
                       max_context=600)  # fmt: skip


def _dense_truth(batch: mla.MlaBatch, scale: float) -> mx.array:
    """mlx-lm's decode path, one row at a time on contiguous latent / k_pe: pe_scores = (q_pe * scale) @ k_pe^T
    masked with finfo.min, then mx.fast SDPA of q_latent over the latent with pe_scores as the additive mask."""
    outs = []
    bs = batch.latent_pool.shape[1]
    num_queries = batch.q_latent.shape[2]
    tables = np.array(batch.block_tables)
    for b, n in enumerate(np.array(batch.context_lens).tolist()):
        slots = mx.array([int(tables[b, t // bs]) * bs + t % bs for t in range(n)])
        latent = batch.latent_pool.reshape(-1, batch.latent_pool.shape[-1])[slots].astype(mx.float32)[None, None]
        k_pe = batch.pe_pool.reshape(-1, batch.pe_pool.shape[-1])[slots].astype(mx.float32)[None, None]
        q_pe = batch.q_pe[b : b + 1].astype(mx.float32)
        pe_scores = (q_pe * scale) @ k_pe.swapaxes(-1, -2)
        pos = n - num_queries + mx.arange(num_queries)[:, None]
        mask = mx.arange(n)[None, :] <= pos
        pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(mx.float32).min, mx.float32))
        outs.append(mx.fast.scaled_dot_product_attention(batch.q_latent[b : b + 1].astype(mx.float32), latent, latent,
                                                         scale=scale, mask=pe_scores))  # fmt: skip
    return mx.concatenate(outs, axis=0)


def _assert_close(got: mx.array, want: mx.array, dtype: mx.Dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol,
                               rtol=rtol)  # fmt: skip


def _lens(bs: int, num_queries: int, long: bool = False) -> list[int]:
    lens = [max(n, num_queries) for n in (bs, bs + 1, 2 * bs + 7, 3 * bs, 1)]  # a context holds its queries
    return lens + [517] if long else lens


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("heads", [1, 4, 16])
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
def test_reference_matches_mlx_lm_style_dense_attention(num_queries: int, heads: int, bs: int, dtype: mx.Dtype) -> None:
    shapes = _shapes(dtype, heads=heads, bs=bs)
    batch = random_mla_batch(shapes, _lens(bs, num_queries), num_queries, seed=heads + bs)
    scale = 96**-0.5
    out = mla_attention_ref(*batch.args, scale=scale)
    assert out.shape == batch.q_latent.shape and out.dtype == dtype
    _assert_close(out, _dense_truth(batch, scale), dtype)


def _project(attn: DeepseekV3Attention, x: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """DeepseekV3Attention.__call__'s projections, as mlx-lm writes them: (q_nope, q_pe, kv_latent, k_pe)."""
    B, L, _ = x.shape
    q = attn.q_proj(x).reshape(B, L, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    compressed_kv, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    kv_latent = attn.kv_a_layernorm(compressed_kv)
    return q_nope, attn.rope(q_pe, offset), kv_latent, attn.rope(k_pe, offset)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_ext)], ids=["reference", "cpu"])
def test_paged_mla_reproduces_deepseek_v3_attention(use_kernel: bool) -> None:
    """mlx-lm's own module with its KVCache (a 37-token prompt: the expanded prefill path; then 3 decode steps:
    the absorbed path) against the latent written to a paged pool and attended through the tables."""
    args = ModelArgs(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                     v_head_dim=16, qk_nope_head_dim=32)  # fmt: skip
    mx.random.seed(11)
    attn = DeepseekV3Attention(args)
    fn = mla_attention_cpu if use_kernel else mla_attention_ref
    bs, table = 16, [5, 2, 7]  # scattered blocks
    flat_latent = np.array(mx.random.normal((8 * bs, 32)))  # garbage everywhere no row owns
    flat_pe = np.array(mx.random.normal((8 * bs, 16)))
    cache = KVCache()
    xs = [mx.random.normal((1, 37, 64), key=mx.random.key(1))] + [mx.random.normal((1, 1, 64), key=mx.random.key(k))
                                                                   for k in (2, 3, 4)]  # fmt: skip
    offset = 0
    for x in xs:
        want = attn(x, create_attention_mask(x, cache, return_array=True), cache)
        q_nope, q_pe, kv_latent, k_pe = _project(attn, x, offset)
        L = x.shape[1]
        slots = [table[t // bs] * bs + t % bs for t in range(offset, offset + L)]
        flat_latent[slots] = np.array(kv_latent.reshape(L, 32))
        flat_pe[slots] = np.array(k_pe.reshape(L, 16))
        latent_pool, pe_pool = mx.array(flat_latent).reshape(8, bs, 1, 32), mx.array(flat_pe).reshape(8, bs, 1, 16)
        offset += L
        out = fn(attn.embed_q(q_nope), q_pe, latent_pool, pe_pool, mx.array([table], mx.int32),
                 mx.array([offset], mx.int32), scale=attn.scale)  # fmt: skip
        got = attn.o_proj(attn.unembed_out(out).transpose(0, 2, 1, 3).reshape(1, L, -1))
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=2e-4)


# (L, R, P, H): DeepSeek's 512 / 64 with 16 and 128 heads (the latter not at L = 40: 10 s a dtype), small and
# odd head counts (row blocks of 1-8), the narrowest vectors.
MLA_SHAPES = [(n, r, p, h) for n in (1, 6, 40)
              for r, p, h in [(512, 64, 16), (512, 64, 128), (64, 32, 1), (64, 32, 3), (16, 16, 16), (64, 16, 20),
                              (64, 32, 5), (32, 16, 14), (64, 32, 7)]
              if not (n == 40 and h == 128)]  # fmt: skip


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("num_queries, r, p, heads", MLA_SHAPES)
def test_cpu_primitive_matches_reference(num_queries: int, heads: int, r: int, p: int, dtype: mx.Dtype) -> None:
    shapes = _shapes(dtype, heads=heads, r=r, p=p)
    batch = random_mla_batch(shapes, _lens(16, num_queries, long=True), num_queries, seed=heads + r)
    scale = (r + p) ** -0.5
    got = mla_attention_cpu(*batch.args, scale=scale)
    assert got.shape == batch.q_latent.shape and got.dtype == dtype
    _assert_close(got, mla_attention_ref(*batch.args, scale=scale), dtype)


@needs_ext
@pytest.mark.parametrize("batch_size, num_queries, max_tokens", [(1, 1, 2048), (1, 2, 32768), (64, 1, 32768)])
def test_cpu_split_follows_idle_threads(batch_size: int, num_queries: int, max_tokens: int) -> None:
    """The context is split only while rows alone leave threads idle; a full batch never allocates partials."""
    ext = cpu_ext.load()
    assert ext is not None
    hpi, qt, parts, part_size = ext.mla_plan(batch_size, 16, num_queries, max_tokens)
    assert parts * part_size >= max_tokens and part_size % 16 == 0 and 16 % hpi == 0
    items = batch_size * (16 // hpi) * -(-num_queries // qt)
    if items >= 4 * ext.num_threads():
        assert parts == 1
    else:
        assert parts > 1 and items * parts >= 4 * ext.num_threads()


@needs_ext
def test_cpu_split_decode_matches_reference() -> None:
    shapes = _shapes(heads=4)
    batch = random_mla_batch(shapes, [1029], 1, seed=9)
    ext = cpu_ext.load()
    assert ext is not None and ext.mla_plan(1, 4, 1, batch.block_tables.shape[1] * 16)[2] > 1  # split + reduction
    _assert_close(mla_attention_cpu(*batch.args, scale=0.1), mla_attention_ref(*batch.args, scale=0.1), mx.float32)


@pytest.mark.parametrize("fn", [mla_attention_ref, pytest.param(mla_attention_cpu, marks=needs_ext)],
                         ids=["reference", "cpu"])  # fmt: skip
def test_context_past_the_table_reads_only_the_table(fn: Any) -> None:
    batch = random_mla_batch(_shapes(), [40, 40], 2, seed=3)
    tables = batch.block_tables[:, :2]  # 32 tokens: row 0's "40" runs 8 past its table
    lens = mx.array([40, 30], mx.int32)
    args = (batch.q_latent, batch.q_pe, batch.latent_pool, batch.pe_pool, tables, lens)
    got = fn(*args, scale=0.1)
    # The truth: row 0 as if its context were the 32 positions the table holds, its queries at 38 and 39.
    ref = mla_attention_ref(*args[:4], tables, mx.array([32, 30], mx.int32), scale=0.1)
    np.testing.assert_allclose(np.array(got[1]), np.array(ref[1]), atol=2e-5, rtol=2e-5)
    assert bool(mx.all(mx.isfinite(got)).item())


def test_bad_shapes_are_typed_errors() -> None:
    batch = random_mla_batch(_shapes(), [5], 1)
    with pytest.raises(ValueError, match="q_pe"):
        mla_attention_ref(batch.q_latent, batch.q_pe[:, :2], *batch.args[2:], scale=1.0)
    with pytest.raises(ValueError, match="pools"):
        mla_attention_ref(batch.q_latent, batch.q_pe, batch.pe_pool, batch.latent_pool, *batch.args[4:], scale=1.0)


@needs_ext
def test_dispatcher_runs_the_primitive_unless_references_are_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted(*a: Any, **k: Any) -> mx.array:
        calls.append(1)
        return mla_attention_cpu(*a, **k)

    monkeypatch.setitem(mla.KERNELS, "cpu", dataclasses.replace(mla.KERNELS["cpu"], fn=counted))
    batch = random_mla_batch(_shapes(), [20, 33], 1)
    out = mla_attention(*batch.args, scale=0.1)
    assert calls == [1]
    monkeypatch.setenv("TRILLM_KERNELS", "ref")
    assert mx.array_equal(mla_attention(*batch.args, scale=0.1), mla_attention_ref(*batch.args, scale=0.1))
    assert calls == [1]
    _assert_close(out, mla_attention_ref(*batch.args, scale=0.1), mx.float32)


def test_the_self_check_runs_each_attention_op_only_for_its_models(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = (selfcheck.PAGED_ATTENTION, mla.OP)
    plain = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=2, chunk=8, max_context=140)
    report = selfcheck.select_kernels(plain, ops=ops, timing_iters=1).report
    assert next(r for r in report.ops if r.op == "mla_attention").reason == "not used by this model"
    report = selfcheck.select_kernels(_shapes(), ops=ops, timing_iters=1).report
    assert next(r for r in report.ops if r.op == "paged_attention").reason == "not used by this model"


@needs_ext
def test_the_self_check_passes_the_cpu_primitive_and_the_selection_runs_it() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", selfcheck.KernelFallbackWarning)
        sel = selfcheck.select_kernels(_shapes(), "strict", ops=(mla.OP,), timing_iters=1)
    (op,) = sel.report.ops
    assert op.backend == "cpu" and not op.failed, op
    if not op.phases:  # one decision for both phases (else each call is routed by its phase)
        assert sel.mla_attention is (mla_attention_cpu if op.implementation == "cpu" else mla_attention_ref)


def test_mla_is_decided_per_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel faster in decode only runs decode; prefill calls go to the reference."""
    calls: list[int] = []

    def kernel(*a: Any, **k: Any) -> mx.array:
        calls.append(a[0].shape[2])
        return mla_attention_ref(*a, **k)

    monkeypatch.setitem(mla.KERNELS, "cpu", Kernel(kernel))
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: {"decode": (1.0, 2.0), "prefill": (3.0, 2.0)})
    sel = selfcheck.select_kernels(_shapes(), ops=(mla.OP,))
    assert dict(sel.report.ops[0].phases or ()) == {"decode": "cpu", "prefill": "reference"}
    calls.clear()
    for num_queries in (1, 4):
        batch = random_mla_batch(_shapes(), [20], num_queries)
        sel.mla_attention(*batch.args, scale=0.1)
    assert calls == [1]


def test_a_wrong_mla_kernel_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(mla.KERNELS, "cpu", Kernel(lambda *a, **k: mla_attention_ref(*a, **k) * 1.01))
    with pytest.warns(selfcheck.KernelFallbackWarning, match="mla_attention.*exceeds atol"):
        sel = selfcheck.select_kernels(_shapes(), ops=(mla.OP,))
    assert sel.report.ops[0].failed and sel.mla_attention is mla_attention_ref


def test_random_batch_reserves_block_zero() -> None:
    batch = random_mla_batch(_shapes(), [16, 17, 1], 1, seed=4)
    tables = np.array(batch.block_tables)
    owned = [int(x) for row, n in zip(tables, [1, 2, 1]) for x in row[:n]]
    assert RESERVED_BLOCK not in owned and len(set(owned)) == len(owned)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: the emulator needs it")
def test_the_shared_gpu_body_passes_the_self_check_in_the_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Metal/CUDA MLA body (via the g++ emulator) through every self-check case, split decode included."""
    import kernel_emulator

    kernel_emulator.install()
    monkeypatch.setitem(mla.KERNELS, "cpu", Kernel(lambda *a, **k: mla.mla_attention_kernel(kernel_emulator.BACKEND,
                                                                                             *a, **k)))  # fmt: skip
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: (0.0, 1.0))  # the emulator is not a speed
    shapes = dataclasses.replace(_shapes(heads=2, r=64, p=32), max_batch=2, max_context=200)
    with warnings.catch_warnings():
        warnings.simplefilter("error", selfcheck.KernelFallbackWarning)
        report = selfcheck.select_kernels(shapes, "strict", ops=(mla.OP,)).report
    assert report.implementation("mla_attention") == "cpu", report
