"""The Metal compile tool: MLX's generated wrapper rebuilt, type-checked by g++ against a stand-in header.

No Metal compiler exists off macOS; `check` must say so. The stand-in check is C++, not Metal: it proves the
generated text is well-formed (declarations, templates, the prelude's names), not that Metal accepts it.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import backend as kb
from trillm.kernels.kv_gather import GATHER
from trillm.kernels.paged_attention import ATTN_FINAL
from trillm.kernels.tools import metal_compile as mc
from trillm.kernels.tools.variants import DEFAULT_SHAPES, Variant, all_dtypes, record

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")


@pytest.fixture(scope="module")
def variants() -> list[Variant]:
    return record("metal", all_dtypes(DEFAULT_SHAPES))


def test_every_variant_is_recorded(variants: list[Variant]) -> None:
    names = {v.spec.name for v in variants}
    assert names == {"paged_attn_final", "paged_attn_partial", "paged_attn_reduce", "kv_gather", "gated_delta",
                     "paged_attn_final_int8", "paged_attn_partial_int8", "kv_quantize_int8",  # these three: int8 cache
                     "ssm_update", "depthwise_conv1d"}
    delta = {(dict(v.template)["Dk"], dict(v.template)["VEC_G"], dict(v.template)["HAS_MASK"], v.input_dtypes[0])
             for v in variants if v.spec.name == "gated_delta"}
    assert {(128, False, True, mx.bfloat16), (64, True, False, mx.float16), (128, False, False, mx.float32)} <= delta
    ssm = {(dict(v.template)["G"], dict(v.template)["Ds"], dict(v.template)["HAS_STATE"], dict(v.template)["HAS_MASK"],
            v.input_dtypes[0]) for v in variants if v.spec.name == "ssm_update"}
    # decode with a state and no mask, decode masked, prefill without a state with padding
    assert {(1, 128, True, False, mx.float16), (8, 64, True, True, mx.bfloat16), (1, 128, False, True, mx.float32)} <= ssm
    assert {v.input_dtypes[0] for v in variants if v.spec == GATHER} == {mx.float32, mx.float16, mx.bfloat16, mx.int8}
    int8 = {v.input_dtypes[0] for v in variants if v.spec.name in ("paged_attn_final_int8", "kv_quantize_int8")}
    assert int8 == {mx.float32, mx.float16, mx.bfloat16}  # queries / new K/V of every dtype over the int8 cache


def test_source_follows_mlx_write_signature(variants: list[Variant]) -> None:
    """Spot-check against mlx/backend/common/metal_kernel.cpp (write_signature, write_template, the kernel name)."""
    v = next(v for v in variants if v.spec == GATHER and v.input_dtypes[0] == mx.float16 and dict(v.template)["BS"] == 32)
    name = "custom_kernel_trillm_kv_gather__float16_t_32_2_64_float16_t_int32_t_int32_t_float16_t"
    assert mc.kernel_name(v) == name
    src = mc.metal_source(v)
    assert src.startswith(kb.METAL_PRELUDE)
    assert (f"template <typename T, int BS, int HKV, int D>\n[[kernel]] void {name}(\n"
            "  const device float16_t* pool [[buffer(0)]],\n  const device int32_t* block_tables [[buffer(1)]],\n"
            "  const device int32_t* meta [[buffer(2)]],\n  device float16_t* out [[buffer(3)]],\n"
            "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n") in src  # fmt: skip
    assert src.endswith(f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}<float16_t, 32, 2, 64>) '
                        f"{name}<float16_t, 32, 2, 64>;\n")  # fmt: skip
    final = next(v for v in variants if v.spec == ATTN_FINAL and dict(v.template)["HAS_SINKS"])
    assert mc._template_text(final.template).endswith(", 1>")  # bools stream as 1/0
    src = mc.metal_source(final)
    for attr in ("thread_position_in_threadgroup", "threadgroup_position_in_grid", "thread_index_in_simdgroup",
                 "simdgroup_index_in_threadgroup"):  # fmt: skip
        assert f"  {kb.METAL_ATTRIBUTES[attr]} {attr} [[{attr}]]" in src
    assert "thread_position_in_grid [[" not in src  # not in this body: MLX adds no parameter


def test_constant_inputs_are_named_and_typed_as_mlx_does() -> None:
    v = Variant(GATHER, (mx.float32, mx.int32, mx.int32), (4096, 4, 8), (4, 1, 1), (mx.float32,), (("T", mx.float32),))
    assert mc.kernel_name(v) == "custom_kernel_trillm_kv_gather__float_float_int32_tc_int32_t_float"
    assert "  const constant int32_t* block_tables [[buffer(1)]],\n" in mc.metal_source(v)


@needs_gxx
def test_every_variant_type_checks_against_the_standin(variants: list[Variant]) -> None:
    ok, log = mc.standin_check(variants)
    assert ok, log[-4000:]


@needs_gxx
def test_standin_catches_a_prelude_without_namespace_metal(variants: list[Variant]) -> None:
    prelude = kb.METAL_PRELUDE.replace("using namespace metal;", "")
    ok, log = mc.standin_check([v for v in variants if v.spec == ATTN_FINAL][:1], prelude)
    assert not ok and "simd_sum" in log


@needs_gxx
def test_standin_catches_a_header_naming_a_thread_attribute(variants: list[Variant]) -> None:
    """Past KernelSpec's own guard: a helper using a thread attribute fails on Metal, and here."""
    v = next(v for v in variants if v.spec == GATHER)
    spec = dataclasses.replace(v.spec)
    object.__setattr__(spec, "header", "inline int lane_of() { return thread_index_in_simdgroup; }\n")
    ok, log = mc.standin_check([dataclasses.replace(v, spec=spec)])
    assert not ok and "thread_index_in_simdgroup" in log


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS may have xcrun")
def test_check_needs_macos(capsys: pytest.CaptureFixture[str]) -> None:
    assert mc.main(["check"]) == 2
    assert "needs macOS" in capsys.readouterr().err


def test_sources_are_written(tmp_path: Path) -> None:
    assert mc.main(["sources", "--out", str(tmp_path)]) == 0
    files = list(tmp_path.glob("*.metal"))
    assert files and all(f.read_text().startswith(mc.UTILS_INCLUDE) for f in files)


def test_the_include_dir_holds_mlx_utils_header() -> None:
    """xcrun's -I must name site-packages/mlx/include (where the mlx wheel puts utils.h), not site-packages/include."""
    include = mc.mlx_include_dir()
    assert include.name == "include" and include.parent.name == "mlx"
    assert (include / "mlx" / "backend" / "metal" / "kernels" / "utils.h").is_file()


def test_xcrun_compiles_as_metal_3_1_against_that_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """utils.h uses `bfloat` (Metal 3.1): the command must say -std=metal3.1 and -I the real header folder."""
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **_: object) -> object:
        seen.append(cmd)
        return type("Proc", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(mc.subprocess, "run", fake_run)
    ok, _ = mc.xcrun_compile("kernel text", tmp_path, "k", ["-ffast-math"])
    (cmd,) = seen
    assert ok and cmd[:5] == ["xcrun", "-sdk", "macosx", "metal", "-c"]
    assert "-std=metal3.1" in cmd and "-ffast-math" in cmd
    include = next(Path(a[2:]) for a in cmd if a.startswith("-I"))
    assert (include / "mlx/backend/metal/kernels/utils.h").is_file()
    assert (tmp_path / "k.metal").read_text() == mc.UTILS_INCLUDE + "kernel text"
