"""The shared Metal/CUDA kernel bodies, run on the CPU by the g++ thread emulator, against the references.

Same kernel text, template constants, launch plan and grid as on a GPU (see kernel_emulator.py), so the
algorithm (paging, GQA grouping, online softmax, split-K partitions + reduction, window, sinks, prefill
tiles, the table bound) is verified numerically here; GPU-specific behaviour (memory model, speed) is not.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

import kernel_emulator
from paged_cases import make_case
from trillm.kernels.kv_gather import kv_gather_kernel, kv_gather_ref
from trillm.kernels.paged_attention import launch_plan, paged_attention_kernel, paged_attention_ref

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: the CPU kernel emulator needs it")
EMU = kernel_emulator.BACKEND
# The module (trillm.kernels re-exports the dispatcher under the same name).
attention_module = importlib.import_module("trillm.kernels.paged_attention")
LONG = 517  # past 8 partitions of the decode split policy's 64-token minimum


@pytest.fixture(autouse=True, scope="module")
def _emulator() -> None:
    kernel_emulator.install()


# (lens, L, bs, rep, d, window, with_sinks, dtype, split, softcap)
CASES = [
    pytest.param([16, 17, 40, 1], 1, 16, 3, 64, None, False, mx.float32, False, None, id="decode-gqa3-ragged"),
    pytest.param([LONG, 32, 33], 1, 32, 4, 128, 37, True, mx.float32, True, None, id="decode-splitk-window-sinks"),
    pytest.param([LONG], 1, 16, 2, 32, None, False, mx.float32, True, None, id="decode-splitk-batch1"),
    pytest.param([16, 17, 23], 5, 16, 1, 64, 7, True, mx.float32, False, None, id="prefill-mha-window-sinks"),
    pytest.param([LONG, 9], 2, 16, 8, 64, None, True, mx.float32, True, None, id="prefill-long-gqa8"),  # 2 queries at 517: split
    pytest.param([33, 20], 4, 16, 2, 64, None, False, mx.float16, False, None, id="prefill-f16"),
    pytest.param([16, 17, 40, 1], 1, 16, 3, 64, None, False, mx.float32, False, 1.5, id="decode-softcap"),
    pytest.param([LONG, 32], 1, 32, 2, 64, 37, True, mx.float32, True, 2.0, id="decode-splitk-softcap-window-sinks"),
    pytest.param([16, 17, 23], 5, 16, 2, 64, None, False, mx.float32, False, 1.5, id="prefill-softcap"),
    pytest.param([33, 20], 4, 16, 2, 64, 9, True, mx.float16, False, 2.0, id="prefill-f16-softcap-window-sinks"),
]


@pytest.mark.parametrize("lens, num_queries, bs, rep, d, window, with_sinks, dtype, split, softcap", CASES)
def test_attention_kernel_body(lens, num_queries, bs, rep, d, window, with_sinks, dtype, split, softcap) -> None:  # type: ignore[no-untyped-def]
    case = make_case(lens, bs=bs, hkv=1 if rep == 8 else 2, rep=rep, d=d, num_queries=num_queries, dtype=dtype)
    hq = case.q.shape[1]
    plan = launch_plan(EMU, len(lens), hq, hq // rep, num_queries, d, case.block_tables.shape[1] * bs)
    assert (plan.num_parts > 1) == split  # the split-K cases really split (a short chunk at long context too)
    sinks = mx.array(np.linspace(-1.0, 1.5, hq, dtype=np.float32)) if with_sinks else None
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    scale = d**-0.5 if softcap is None else 0.3  # larger scores, so the cap bends them
    got = paged_attention_kernel(EMU, *args, scale=scale, window=window, sinks=sinks, softcap=softcap)
    want = paged_attention_ref(*args, scale=scale, window=window, sinks=sinks, softcap=softcap)
    tol = 1e-5 if dtype == mx.float32 else 2e-3
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_queries", [1, 3])
def test_context_past_the_table_reads_only_the_table(num_queries: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A context_len beyond max_blocks x block_size must not read the next row's table (Metal never bounds-checks).

    The partition bounds are made loose on purpose (part_size far past the table), so only the body's own
    bound keeps the token loop inside the table.
    """
    plan = attention_module.launch_plan
    monkeypatch.setattr(attention_module, "launch_plan", lambda *a: dataclasses.replace(plan(*a), part_size=1 << 20))
    case = make_case([40, 40], bs=16, hkv=2, rep=2, d=64, num_queries=num_queries, dtype=mx.float32, seed=3)
    tables = case.block_tables[:, :2]  # 32 tokens: row 0's "40" runs 8 tokens past its table
    lens = mx.array([40, 30], dtype=mx.int32)
    args = (case.q, case.k_pool, case.v_pool, tables, lens)
    got = paged_attention_kernel(EMU, *args, scale=0.125)
    want = paged_attention_ref(*args, scale=0.125)  # attends to the 32 positions the table holds
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


def test_gather_kernel_body() -> None:
    case = make_case([16, 17, 40], bs=16, hkv=2, rep=1, d=64, num_queries=1, dtype=mx.float32)
    for max_len in (1, 16, 17, 40):
        got = kv_gather_kernel(EMU, case.k_pool, case.block_tables, max_len)
        assert mx.array_equal(got, kv_gather_ref(case.k_pool, case.block_tables, max_len))


# MLA (kernels/mla_attention.py): (lens, L, heads, R, P, dtype, split)
MLA_CASES = [
    pytest.param([16, 17, 40, 1], 1, 4, 64, 32, mx.float32, False, id="mla-decode-ragged"),
    pytest.param([LONG, 33], 1, 2, 128, 32, mx.float32, True, id="mla-decode-splitk"),
    pytest.param([16, 17, 23], 5, 4, 64, 32, mx.float32, False, id="mla-prefill"),
    pytest.param([LONG, 9], 3, 3, 512, 64, mx.float16, True, id="mla-prefill-f16-deepseek-width"),  # short chunk, long row: split
]


@pytest.mark.parametrize("lens, num_queries, heads, r, p, dtype, split", MLA_CASES)
def test_mla_kernel_body(lens, num_queries, heads, r, p, dtype, split) -> None:  # type: ignore[no-untyped-def]
    from trillm.kernels.layout import ModelShapes
    from trillm.kernels.mla_attention import mla_attention_kernel, mla_attention_ref, random_mla_batch

    shapes = ModelShapes(heads, 1, r, 16, dtype, kv_lora_rank=r, qk_rope_head_dim=p)
    batch = random_mla_batch(shapes, lens, num_queries, seed=heads + r)
    plan = launch_plan(EMU, len(lens), heads, 1, num_queries, r, batch.block_tables.shape[1] * 16)
    assert (plan.num_parts > 1) == split
    scale = (r + p) ** -0.5
    got = mla_attention_kernel(EMU, *batch.args, scale=scale)
    want = mla_attention_ref(*batch.args, scale=scale)
    tol = 1e-5 if dtype == mx.float32 else 2e-3
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol, rtol=tol)
