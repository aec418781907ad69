"""The attention variants beyond plain causal attention (soft-capping, several windows per model, with sinks; chunked; MLA) in the
host-side compile checks: the Metal stand-in (g++) and nvcc for sm_90, on the variants the self-check launches.

The default compile sets (kernels/tools/variants.py DEFAULT_SHAPES) cover window + sinks; these shapes add
soft-capping alone and with them, a model whose layers alternate a window and full attention, chunked attention
(Llama 4), and the MLA kernels (recorded here from their own launcher: tools/variants.py records paged attention
and kv_gather).
"""

from __future__ import annotations

import shutil

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import mla_attention as mla
from trillm.kernels.layout import ModelShapes
from trillm.kernels.tools import cuda_compile as cc
from trillm.kernels.tools import metal_compile as mc
from trillm.kernels.tools.variants import Variant, _recording_factory, all_dtypes, backend_installed, record

VARIANT_SHAPES = (
    ModelShapes(8, 4, 64, 16, mx.float16, softcap=50.0, layer_windows=(64, None), chunk=64, max_batch=9),  # Gemma 2
    ModelShapes(16, 2, 64, 16, mx.float32, sinks=True, softcap=30.0, window=128, chunk=64, max_batch=9),
    ModelShapes(8, 2, 64, 16, mx.float16, attention_chunk=200, chunk=64, max_batch=9),  # Llama 4's chunked layers
)


# DeepSeek V2/V3's widths (16 heads: HPG 2), and a tiny model's.
MLA_SHAPES = (
    ModelShapes(16, 1, 512, 16, mx.float32, kv_lora_rank=512, qk_rope_head_dim=64, chunk=64, max_batch=9),
    ModelShapes(4, 1, 64, 32, mx.float32, kv_lora_rank=64, qk_rope_head_dim=32, chunk=64, max_batch=9),
)


def record_mla(target: str) -> list[Variant]:
    """Every distinct MLA variant the self-check's cases launch on `target` (each dtype), recorded, not run."""
    sink: list[Variant] = []
    name = f"record-mla:{target}"
    with backend_installed(name, _recording_factory(sink), "", target):
        for shapes in all_dtypes(MLA_SHAPES):
            assert mla.KERNELS[target].supports(shapes) is None
            for case in mla.OP.check_cases(shapes):
                mla.mla_attention_kernel(name, *case.args, **case.kwargs)
    seen: dict[tuple[object, ...], Variant] = {}
    for v in sink:
        seen.setdefault(v.key if target == "metal" else (v.spec, v.input_dtypes, v.output_dtypes, v.template), v)
    return list(seen.values())


def test_mla_check_cases_launch_one_pass_split_and_reduction() -> None:
    names = {v.spec.name for v in record_mla("metal")}
    assert names == {"mla_attn_final", "mla_attn_partial", "paged_attn_reduce"}


def _flags(variants: list[Variant]) -> set[tuple[str, int, bool, bool]]:
    out = set()
    for v in variants:
        t = dict(v.template)
        if "WINDOW" in t:
            out.add((v.spec.name, int(t["WINDOW"]), bool(t["HAS_SOFTCAP"]), bool(t.get("HAS_SINKS", False))))
    return out


def test_the_self_check_launches_every_declared_variant() -> None:
    flags = _flags(record("metal", VARIANT_SHAPES[:1]))
    for window in (64, 0):  # both of the model's windows, each in the one-pass and the split-K kernels
        assert {("paged_attn_final", window, True, False), ("paged_attn_partial", window, True, False)} <= flags
    assert not any(not softcap for _, _, softcap, _ in flags)  # this model's every launch soft-caps
    flags = _flags(record("metal", VARIANT_SHAPES[1:]))
    assert ("paged_attn_final", 128, True, True) in flags and ("paged_attn_partial", 128, True, False) in flags


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_metal_variants_type_check_against_the_standin() -> None:
    ok, log = mc.standin_check(record("metal", all_dtypes(VARIANT_SHAPES)) + record_mla("metal"))
    assert ok, log[-4000:]


@pytest.mark.skipif(not cc.nvcc_present(), reason=f"nvcc not found at {cc.NVCC}")
def test_cuda_variants_compile() -> None:
    if not cc.headers_present():
        pytest.skip(f"MLX CUDA device headers missing in {cc.HEADER_DIR} (tests/kernels/test_cuda_compile.py fetches them)")
    seen: dict[tuple[object, ...], Variant] = {}
    for v in record("cuda", all_dtypes(VARIANT_SHAPES)) + record_mla("cuda"):
        seen.setdefault((v.spec, v.input_dtypes, v.output_dtypes, v.template), v)
    failed = cc.compile_together(list(seen.values()))
    assert failed is None, f"{failed.variant.spec.name} failed to compile:\n{failed.log[-4000:]}"
