"""Shared by the quantized caches' GPU tests: the distinct variants some shapes launch, type-checked against
the Metal stand-in and compiled by nvcc (skipped where nvcc or MLX's CUDA headers are missing)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels.layout import ModelShapes
from trillm.kernels.tools import cuda_compile as cc
from trillm.kernels.tools import metal_compile as mc
from trillm.kernels.tools.variants import Variant, all_dtypes, record


def distinct_variants(target: str, shapes: Iterable[ModelShapes], keep: Callable[[Variant], bool]) -> list[Variant]:
    """The variants `shapes` launch on `target` in three dtypes that `keep` takes, each once (CUDA compiles
    one per template and dtypes: its key ignores the constant inputs' sizes)."""
    seen: dict[tuple[object, ...], Variant] = {}
    for v in record(target, all_dtypes(shapes)):
        if keep(v):
            seen.setdefault(v.key if target == "metal" else (v.spec, v.input_dtypes, v.output_dtypes, v.template), v)
    return list(seen.values())


def assert_metal_standin_accepts(variants: list[Variant]) -> None:
    assert {mx.float32, mx.float16, mx.bfloat16} <= {v.input_dtypes[0] for v in variants}
    ok, log = mc.standin_check(variants)
    assert ok, log[-4000:]


def assert_nvcc_compiles(variants: list[Variant]) -> None:
    if not cc.nvcc_present():
        pytest.skip(f"nvcc not found at {cc.NVCC}")
    if not cc.headers_present():
        pytest.skip(f"MLX CUDA device headers missing in {cc.HEADER_DIR} (tests/kernels/test_cuda_compile.py fetches them)")
    failed = cc.compile_together(variants)
    assert failed is None, f"{failed.variant.spec.name} failed to compile:\n{failed.log[-4000:]}"
