"""The GPU kernels' launch plan, sources and variants, checked without running a kernel.

Launches are recorded (tools/variants.py) or the kernel text is inspected.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import backend as kb
from trillm.kernels.kv_gather import GATHER, kv_gather_kernel
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import (
    ATTN_FINAL, ATTN_PARTIAL, ATTN_REDUCE, SPLIT_POLICIES, launch_plan, paged_attention_kernel,
)  # fmt: skip
from trillm.kernels.tools.variants import backend_installed, record

SPECS = (ATTN_FINAL, ATTN_PARTIAL, ATTN_REDUCE, GATHER)


@pytest.mark.parametrize("context", [512, 4096, 32768])
def test_prefill_never_splits_the_context(context: int) -> None:
    """One partition for L > 1: split-K would size the partial buffer B x Hq x L x num_parts x D (512 MiB/layer)."""
    for backend in ("metal", "cuda"):
        plan = launch_plan(backend, 1, 32, 8, 512, 128, context)
        assert plan.num_parts == 1 and plan.part_size >= context
        assert plan.num_qtiles * plan.qt >= 512


@pytest.mark.parametrize("context", [128, 512, 2048])
def test_decode_at_batch_one_fills_the_gpu(context: int) -> None:
    """14 query heads on 2 KV heads at batch 1: the old fixed 512-token partitions gave 2 threadgroups up to 512 tokens."""
    for backend, policy in SPLIT_POLICIES.items():
        plan = launch_plan(backend, 1, 14, 2, 1, 64, context)
        threadgroups = plan.threadgroups_per_row * (14 // plan.hpg)
        assert threadgroups > 2 and threadgroups >= min(policy.target_threadgroups, 2 * context // policy.min_partition)
        assert plan.part_size >= policy.min_partition and plan.num_parts * plan.part_size >= context


def test_decode_at_large_batch_does_not_split() -> None:
    """Enough threadgroups from the batch alone: no partial buffers, no reduction."""
    assert launch_plan("metal", 64, 32, 8, 1, 128, 8192).num_parts == 1


def test_prefill_tile_is_one_variant_per_model() -> None:
    """QT depends on the model only, so prefill lengths never compile new variants mid-serving."""
    assert len({launch_plan("metal", 1, 9, 3, n, 64, 4096).qt for n in (2, 3, 7, 64, 512)}) == 1


def test_serving_launches_no_variant_the_self_check_did_not() -> None:
    """Every (batch, query length, context) serving can produce maps onto a variant the self-check cases launch."""
    shapes = ModelShapes(9, 3, 64, 16, mx.float16, max_batch=64, chunk=128, max_context=4096)
    checked = {v.key for v in record("metal", [shapes])}
    serving: list[Any] = []

    def factory(**kwargs: Any) -> Any:
        spec = kb.KernelSpec(kwargs["name"].removeprefix("trillm_"), tuple(kwargs["input_names"]),
                             tuple(kwargs["output_names"]), kwargs["source"], kwargs["header"])  # fmt: skip

        def call(*, inputs: list[mx.array], template: Any, output_shapes: Any, output_dtypes: Any, **_: Any) -> Any:
            serving.append((spec, tuple(x.dtype for x in inputs), tuple(n.size < 8 for n in inputs),
                            tuple(x.ndim for x in inputs), tuple(output_dtypes), tuple(template)))  # fmt: skip
            return [mx.zeros(tuple(s), dtype=dt) for s, dt in zip(output_shapes, output_dtypes)]

        return call

    with backend_installed("serve", factory, "", "metal"):
        for batch in (1, 2, 5, 8, 33, 64):
            for length in (1, 2, 17, 128):
                for blocks in (1, 3, 40, 256):
                    q = mx.zeros((batch, 9, length, 64), dtype=mx.float16)
                    pool = mx.zeros((blocks * batch + 1, 16, 3, 64), dtype=mx.float16)
                    tables = mx.ones((batch, blocks), dtype=mx.int32)
                    lens = mx.full((batch,), blocks * 16, dtype=mx.int32)
                    paged_attention_kernel("serve", q, pool, pool, tables, lens, scale=0.125)
                    kv_gather_kernel("serve", pool, tables, blocks * 16)
    assert set(serving) <= checked


def test_inputs_never_switch_address_space() -> None:
    """MLX passes inputs under 8 elements as `constant`, a second compile: every launch pads its small inputs."""
    shapes = [ModelShapes(2, 1, 32, 16, mx.float32, max_batch=9), ModelShapes(9, 3, 64, 16, mx.float16, sinks=True)]
    variants = record("metal", shapes)
    assert variants and not any(any(v.constant_inputs) for v in variants)


def test_huge_pools_launch_within_int32_grids() -> None:
    """Pools over 2^31 elements (lazy arrays: never allocated) keep every grid dimension in MLX's int range."""
    grids: list[tuple[int, int, int]] = []

    def factory(**_: Any) -> Any:
        def call(*, grid: tuple[int, int, int], output_shapes: Any, output_dtypes: Any, **__: Any) -> Any:
            grids.append(grid)
            return [mx.zeros(tuple(s), dtype=dt) for s, dt in zip(output_shapes, output_dtypes)]

        return call

    pool = mx.zeros((300_000, 16, 8, 128), dtype=mx.float16)  # 4.9e9 elements
    assert pool.size > 2**32
    with backend_installed("huge", factory, "", "metal"):
        tables = mx.zeros((4, 8192), dtype=mx.int32)
        for length in (1, 512):
            q = mx.zeros((4, 32, length, 128), dtype=mx.float16)
            paged_attention_kernel("huge", q, pool, pool, tables, mx.full((4,), 8192 * 16, mx.int32), scale=0.1)
        kv_gather_kernel("huge", pool, tables, 8192 * 16)
    assert grids and all(0 < g < 2**31 for grid in grids for g in grid)
    for spec in (ATTN_FINAL, ATTN_PARTIAL, GATHER):  # pool offsets are formed in 64 bits
        assert re.search(r"\(size_t\)\s*(blk|block_tables)", spec.body), spec.name


def test_params_are_made_once_per_value() -> None:
    """meta/scale arrays are shared by a step's layers instead of built per call."""
    assert kb.int32_params(4, 1, 64, 1) is kb.int32_params(4, 1, 64, 1)
    assert kb.float32_params(0.125) is kb.float32_params(0.125)
    assert kb.int32_params(4, 1).size == 8 and kb.at_least_8(mx.arange(3)).size == 8


def test_fixed_trip_loops_unroll() -> None:
    """Per-lane arrays (qv, acc, kf, vf) stay in registers only when loops over R, DPL, QT, NW fully unroll."""
    loops = re.compile(r"^(\s*)(UNROLL )?for \(int \w+ = 0; \w+ < (R|DPL|QT|NW);", re.M)
    for spec in SPECS:
        found = loops.findall(spec.body)
        assert all(unroll for _, unroll, _ in found), f"{spec.name}: a fixed-trip loop without UNROLL"
    assert len(loops.findall(ATTN_FINAL.body)) >= 8
    for prelude in (kb.METAL_PRELUDE, kb.CUDA_PRELUDE):
        assert "#define UNROLL _Pragma(" in prelude


def test_token_loop_is_32_bit() -> None:
    """Apple GPUs emulate 64-bit multiplies: the token loop forms 64-bit offsets only when it enters a block."""
    body = ATTN_FINAL.body
    loop = body[body.index("for (int t = start + warp"):body.index("// Merge the simdgroups")]
    wide = [line.strip() for line in loop.splitlines() if "size_t" in line]
    assert wide == ["const size_t blk = (size_t)block_tables[b * max_blocks + j];"]
    assert loop.index("if (j != cur)") < loop.index("size_t")
    assert "kb[off + e]" in loop and "lane_off = kvh * D + lane * DPL" in body  # contiguous per-lane loads


def test_metal_kernels_build_with_fast_math(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(mx.fast, "metal_kernel", lambda **kw: seen.update(kw))
    kb.FACTORIES["metal"](name="x", input_names=["a"], output_names=["o"], source="", header="")
    assert seen["compile_options"] == {"math_mode": "fast"}


def test_a_header_naming_a_thread_attribute_is_refused() -> None:
    """Metal adds thread-attribute parameters only for names in the body; CUDA's macros would hide the mistake."""
    helper = "inline float lane_value(float x) { return x * thread_index_in_simdgroup; }"
    with pytest.raises(ValueError, match="thread_index_in_simdgroup"):
        kb.KernelSpec("bad", ("a",), ("o",), "o[0] = lane_value(a[0]);", header=helper)
    for spec in SPECS:
        assert not kb.metal_attributes_in(kb.header_for("metal", spec)), spec.name


def test_metal_prelude_brings_in_namespace_metal() -> None:
    assert "using namespace metal;" in kb.METAL_PRELUDE
