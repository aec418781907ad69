"""The shared Metal/CUDA kernel bodies, run on the CPU by the g++ thread emulator, against the references.

Same kernel text, template constants, launch plan and grid as on a GPU (see kernel_emulator.py), so the
algorithm (paging, GQA grouping, online softmax, split-K partitions + reduction, window, sinks, prefill
tiles) is verified numerically here; GPU-specific behaviour (memory model, speed) is not.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

import kernel_emulator
from paged_cases import make_case
from trillm.kernels import _attention_kernels as attn
from trillm.kernels import _kv_cache_kernels as kvk
from trillm.kernels.kv_cache import copy_blocks_ref, kv_gather_ref, kv_write_ref
from trillm.kernels.paged_attention import paged_attention_ref

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: the CPU kernel emulator needs it")
EMU = kernel_emulator.BACKEND
LONG = attn.PARTITION_SIZE + 5  # two partitions: the split-K kernel plus the reduction


@pytest.fixture(autouse=True, scope="module")
def _emulator() -> None:
    kernel_emulator.install()


# (lens, L, bs, rep, d, window, with_sinks, dtype)
CASES = [
    pytest.param([16, 17, 40, 1], 1, 16, 3, 64, None, False, mx.float32, id="decode-gqa3-ragged"),
    pytest.param([LONG, 32, 33], 1, 32, 4, 128, 37, True, mx.float32, id="decode-splitk-window-sinks"),
    pytest.param([16, 17, 23], 5, 16, 1, 64, 7, True, mx.float32, id="prefill-mha-window-sinks"),
    pytest.param([LONG, 9], 2, 16, 8, 64, None, True, mx.float32, id="prefill-splitk-gqa8"),
    pytest.param([33, 20], 4, 16, 2, 64, None, False, mx.float16, id="prefill-f16"),
]


@pytest.mark.parametrize("lens, num_queries, bs, rep, d, window, with_sinks, dtype", CASES)
def test_attention_kernel_body(lens, num_queries, bs, rep, d, window, with_sinks, dtype) -> None:  # type: ignore[no-untyped-def]
    case = make_case(lens, bs=bs, hkv=1 if rep == 8 else 2, rep=rep, d=d, num_queries=num_queries, dtype=dtype)
    hq = case.q.shape[1]
    plan = attn.launch_plan(len(lens), hq, hq // rep, num_queries, d, case.block_tables.shape[1] * bs)
    assert (plan["num_parts"] > 1) == (max(lens) > attn.PARTITION_SIZE)  # the split-K cases really split
    sinks = mx.array(np.linspace(-1.0, 1.5, hq, dtype=np.float32)) if with_sinks else None
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    got = attn.paged_attention_kernel(EMU, *args, d**-0.5, window, sinks)
    want = paged_attention_ref(*args, scale=d**-0.5, window=window, sinks=sinks)
    tol = 1e-5 if dtype == mx.float32 else 2e-3
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol, rtol=tol)


def test_kv_cache_kernel_bodies() -> None:
    case = make_case([16, 17, 40], bs=16, hkv=2, rep=1, d=64, num_queries=1, dtype=mx.float32)
    for max_len in (1, 16, 17, 40):
        got = kvk.kv_gather_kernel(EMU, case.k_pool, case.block_tables, max_len)
        assert mx.array_equal(got, kv_gather_ref(case.k_pool, case.block_tables, max_len))
    slots = mx.array([3, 33, 48], dtype=mx.int32)
    new = mx.random.normal((3, 2, 64), key=mx.random.key(0))
    got_k, got_v = kvk.kv_write_kernel(EMU, case.k_pool, case.v_pool, new, -new, slots)
    want_k, want_v = kv_write_ref(mx.array(case.k_pool), mx.array(case.v_pool), new, -new, slots)
    assert mx.array_equal(got_k, want_k) and mx.array_equal(got_v, want_v)
    src, dst = mx.array([1, 2], dtype=mx.int32), mx.array([3, 4], dtype=mx.int32)
    got = kvk.copy_blocks_kernel(EMU, case.k_pool, src, dst)
    assert mx.array_equal(got, copy_blocks_ref(mx.array(case.k_pool), src, dst))
