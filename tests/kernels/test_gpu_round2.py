"""The GPU kernels' launch plan, empty rows, shape checks and the check cases, without a GPU.

Numbers come from the g++ emulator running the real Metal/CUDA bodies (tests/kernels/kernel_emulator.py);
launches are recorded (tools/variants.py).
"""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

import kernel_emulator
from trillm.kernels import cpu_ext
from trillm.kernels.layout import ModelShapes, random_batch
from trillm.kernels.paged_attention import (
    CHECK_QUERIES, MAX_PARTIAL_BYTES, OP, SPLIT_POLICIES, _case, launch_plan, paged_attention,
    paged_attention_cpu, paged_attention_kernel, paged_attention_ref,
)  # fmt: skip
from trillm.kernels.selfcheck import PRESETS
from trillm.kernels.tools.variants import DEFAULT_SHAPES, _recording_factory, backend_installed, record

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
EMU = kernel_emulator.BACKEND


@pytest.fixture(scope="module", autouse=True)
def _emulator() -> None:
    kernel_emulator.install()


@pytest.mark.parametrize("backend", sorted(SPLIT_POLICIES))
@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("num_queries", [2, 4, 8])
def test_a_short_chunk_at_long_context_splits(backend: str, context: int, num_queries: int) -> None:
    """A last prompt chunk of 2-8 tokens at 32k got 2-4 threadgroups with num_parts forced to 1."""
    plan = launch_plan(backend, 1, 32, 8, num_queries, 128, context)
    threadgroups = plan.threadgroups_per_row * (32 // plan.hpg)
    assert plan.num_parts > 1 and threadgroups >= SPLIT_POLICIES[backend].target_threadgroups // 2
    assert plan.num_parts * plan.part_size >= context


@pytest.mark.parametrize("backend", sorted(SPLIT_POLICIES))
def test_the_partial_outputs_stay_within_their_bound(backend: str) -> None:
    for batch in (1, 2, 9, 64):
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64), (64, 8, 256), (14, 2, 64)):
            for num_queries in (1, 2, 7, 64, 512):
                for context in (64, 1029, 32768, 131072):
                    plan = launch_plan(backend, batch, hq, hkv, num_queries, d, context)
                    if plan.num_parts > 1:
                        assert batch * hq * num_queries * plan.num_parts * d * 4 <= MAX_PARTIAL_BYTES
                    assert plan.num_parts * plan.part_size >= context and plan.num_qtiles * plan.qt >= num_queries


@needs_gxx
@pytest.mark.parametrize("long", [False, True], ids=["final", "split"])
@pytest.mark.parametrize("num_queries, with_sinks", [(1, False), (3, False), (1, True)])
def test_a_row_that_sees_nothing_is_zero_not_nan(num_queries: int, with_sinks: bool, long: bool) -> None:
    """Row 0 has no token (context 0, no sink): 0 as the CPU primitive gives, through the final kernel and
    through the split path (partial + reduce) that a long row 1 forces."""
    shapes = ModelShapes(4, 2, 32, 16, mx.float32)
    other = 600 if long else 20
    batch = random_batch(shapes, [num_queries, other], num_queries, seed=11)
    lens = mx.array([0, other], dtype=mx.int32)
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables, lens)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0]) if with_sinks else None
    plan = launch_plan(EMU, 2, 4, 2, num_queries, 32, batch.block_tables.shape[1] * 16)
    assert (plan.num_parts > 1) == long
    got = np.array(paged_attention_kernel(EMU, *args, scale=0.2, sinks=sinks))
    assert np.isfinite(got).all()
    if not with_sinks:
        assert (got[0] == 0).all()
        if cpu_ext.load() is not None:
            assert (np.array(paged_attention_cpu(*args, scale=0.2))[0] == 0).all()
    else:  # a sink alone: every probability on the sink, so the output is 0 there too
        assert np.abs(got[0]).max() < 1e-6
    want = np.array(paged_attention_ref(*args, scale=0.2, sinks=sinks))
    np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-5)


def _batch() -> tuple[Any, ...]:
    b = random_batch(ModelShapes(4, 2, 32, 16, mx.float32), [20, 40], 1, seed=2)
    return b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens


@pytest.mark.parametrize("entry", ["dispatcher", "kernel"])
def test_shape_mismatches_are_clear_errors(entry: str) -> None:
    q, k, v, tables, lens = _batch()

    def call(*args: Any) -> Any:
        if entry == "dispatcher":
            return paged_attention(*args, scale=0.2)
        return paged_attention_kernel(EMU, *args, scale=0.2)

    with pytest.raises(ValueError, match="head dim 64 differs from the pool's 32"):
        call(mx.zeros((2, 4, 1, 64)), k, v, tables, lens)
    with pytest.raises(ValueError, match="v_pool .* must have k_pool's shape"):
        call(q, k, v[:, :8], tables, lens)
    with pytest.raises(ValueError, match="not a multiple of the pool's 2 KV heads"):
        call(mx.zeros((2, 3, 1, 32)), k, v, tables, lens)
    with pytest.raises(ValueError, match="block_tables must be"):
        call(q, k, v, tables[:1], lens)


def _variant_keys(cases: list[Any], target: str = "metal") -> set[Any]:
    sink: list[Any] = []
    with backend_installed("rec", _recording_factory(sink), "", target):
        for case in cases:
            paged_attention_kernel("rec", *case.args, **case.kwargs)
    return {v.key for v in sink}


@pytest.mark.parametrize("shapes", [*DEFAULT_SHAPES, *(s.__class__(**{**{f: getattr(s, f) for f in s.__dataclass_fields__},
                                    "chunk": 512, "max_batch": 64}) for s in PRESETS.values())], ids=str)  # fmt: skip
def test_a_whole_chunk_at_batch_9_adds_no_variant(shapes: ModelShapes) -> None:
    """The dropped check case (B = 9 at L = chunk) would launch only variants the kept cases launch."""
    if not OP.applies(shapes):  # an MLA preset: the self-check never runs paged attention's cases for it
        pytest.skip("paged attention does not apply to these shapes")
    chunk = min(shapes.chunk, shapes.max_context)
    assert chunk not in CHECK_QUERIES
    kept = OP.check_cases(shapes)
    # Only the windows past the first (each checked at B = 9 alone) keep a whole chunk at B = 9.
    assert sum(c.label.startswith(f"B=9 L={chunk} ") for c in kept) == 2 * (len(shapes.windows) - 1)
    ladder = [chunk + j for j in (0, 1, shapes.block_size - 1, shapes.block_size, 2 * shapes.block_size + 3)]
    dropped = []
    for long in (False, True):
        lens = [min(ladder[i % len(ladder)], shapes.max_context) for i in range(9)]
        if long:
            lens[-1] = min(max(1029, chunk), shapes.max_context)
        dropped.append(_case(shapes, "dropped", lens, chunk, seed=7, window=shapes.windows[0]))
    for target in ("metal", "cuda"):
        assert _variant_keys(dropped, target) <= _variant_keys(kept, target)
    recorded = {v.key for v in record("metal", [shapes]) if v.spec.name.startswith("paged_attn")}
    assert recorded == _variant_keys(kept)  # what the compile checks see is what the self-check launches
