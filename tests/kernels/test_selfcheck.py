"""The start-up self-check with the back-end mocked: kernels that raise, return wrong numbers, run slower.

The CPU default device is back-end "cpu"; registering an implementation there is exactly how the MLX C++
extension plugs in, so the mocks travel the real path (dispatcher, check, timing, cache, report).
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path
from typing import Any

import importlib

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

import kernel_emulator
from trillm.kernels import selfcheck
from trillm.kernels.backend import Kernel
from trillm.kernels.kv_gather import KERNELS as GATHER_KERNELS
from trillm.kernels.kv_gather import kv_gather_ref
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import KERNELS as ATTENTION_KERNELS
from trillm.kernels.paged_attention import OP as ATTENTION_OP
from trillm.kernels.paged_attention import launch_plan, paged_attention_kernel, paged_attention_ref
from trillm.kernels.selfcheck import (
    CACHE_ENV, KernelCheckError, KernelFallbackWarning, select_kernels,
)  # fmt: skip

SHAPES = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=4, chunk=8, max_context=256)

pa = importlib.import_module("trillm.kernels.paged_attention")  # the module (the package re-exports the function)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)
    return tmp_path / "kernel-cache"


class Calls:
    def __init__(self) -> None:
        self.n = 0


def _install(monkeypatch: pytest.MonkeyPatch, fn: Any, registry: dict[str, Kernel] = ATTENTION_KERNELS) -> None:
    monkeypatch.setitem(registry, "cpu", Kernel(fn))


def raising(*args: Any, **kwargs: Any) -> mx.array:
    raise RuntimeError("[metal::Device] Unable to build metal library from source: error: use of undeclared identifier")


def wrong(*args: Any, **kwargs: Any) -> mx.array:
    return paged_attention_ref(*args, **kwargs) + 0.01


def slower(*args: Any, **kwargs: Any) -> mx.array:
    out = paged_attention_ref(*args, **kwargs)
    mx.eval(out)
    time.sleep(0.1)  # far beyond timing noise, even on a loaded machine
    return out


def test_no_kernel_means_the_reference_and_no_check(monkeypatch: pytest.MonkeyPatch) -> None:
    for op in selfcheck.ENGINE_OPS:  # as where the CPU extension cannot be built
        monkeypatch.delitem(op.kernels, "cpu", raising=False)
    sel = select_kernels(SHAPES)
    assert sel.report.backend == "cpu"
    assert sel.report.implementations() == {op.name: "reference" for op in selfcheck.ENGINE_OPS}
    assert sel.paged_attention is paged_attention_ref and sel.kv_gather is kv_gather_ref
    assert (sel.kv_write_int8, sel.rms_norm, sel.rope, sel.silu_mul, sel.linear, sel.mla_attention,
            sel.quant_linear, sel.depthwise_conv1d) == tuple(op.runs_instead for op in selfcheck.ENGINE_OPS[2:-2])  # or MLX's quantized matmul
    assert [op.name for op in selfcheck.ENGINE_OPS[-2:]] == ["gated_delta", "ssm_update"]
    assert sel.gated_delta is None and sel.ssm_update is None  # mlx-lm's own runs
    json.dumps(sel.report.as_dict())


def test_a_kernel_that_raises_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, raising)
    with pytest.warns(KernelFallbackWarning) as caught:
        sel = select_kernels(SHAPES)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "paged_attention" in text and "cpu" in text and "Unable to build metal library" in text
    op = sel.report.ops[0]
    assert op.implementation == "reference" and op.failed and "RuntimeError" in op.reason
    assert sel.paged_attention is paged_attention_ref


def test_a_kernel_with_wrong_numbers_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, wrong)
    with pytest.warns(KernelFallbackWarning, match="exceeds atol"):
        sel = select_kernels(SHAPES)
    assert sel.report.implementation("paged_attention") == "reference" and sel.report.ops[0].failed


def test_a_kernel_with_non_finite_output_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, lambda *a, **k: paged_attention_ref(*a, **k) * mx.nan)
    with pytest.warns(KernelFallbackWarning, match="non-finite"):
        assert select_kernels(SHAPES).report.implementation("paged_attention") == "reference"


def test_gather_must_be_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, lambda pool, tables, n: kv_gather_ref(pool, tables, n) * (1 + 1e-7), GATHER_KERNELS)
    with pytest.warns(KernelFallbackWarning, match="exact"):
        assert select_kernels(SHAPES).report.implementation("kv_gather") == "reference"


def test_a_slower_kernel_loses_without_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, slower)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        sel = select_kernels(SHAPES, timing_iters=2)
    op = sel.report.ops[0]
    assert op.implementation == "reference" and not op.failed and "slower" in op.reason
    assert op.kernel_ms is not None and op.reference_ms is not None and op.kernel_ms > op.reference_ms


@pytest.mark.parametrize("kernel_ms, wins", [(1.04, True), (1.06, False)])
def test_a_tie_within_the_margin_goes_to_the_kernel(monkeypatch: pytest.MonkeyPatch, kernel_ms: float,
                                                     wins: bool) -> None:
    """A fallback is cached for later starts, so a difference inside the timing noise keeps the kernel."""
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: (kernel_ms, 1.0))
    _install(monkeypatch, ATTENTION_OP.reference)
    op = select_kernels(SHAPES, timing_iters=2).report.ops[0]
    assert (op.implementation == "cpu") is wins
    assert ("within 5% of the reference" in op.reason) is wins


def test_the_linear_timing_case_streams_a_weight_larger_than_the_caches() -> None:
    """Decode streams every weight from memory; a cache-hot timing once picked BLAS and halved decode speed.
    SmolLM2's shapes get a weight beyond the caches; a tiny model's stays as small as its LM head."""
    from trillm.kernels import linear

    smol = dataclasses.replace(SHAPES, hidden_size=576, intermediate_size=1536, vocab_size=49152, max_batch=8)
    cases = linear.OP.timing_cases(smol)
    assert [c.args[0].shape[0] for c in cases] == [1, 8]
    for c in cases:
        assert c.args[1].nbytes >= 64 << 20 and c.args[1].shape[1] == 576
    tiny = dataclasses.replace(SHAPES, hidden_size=64, vocab_size=512, max_batch=64)
    assert [(c.args[0].shape[0], c.args[1].shape) for c in linear.OP.timing_cases(tiny)] == [(1, (480, 64)),
                                                                                          (32, (480, 64))]


def test_a_faster_kernel_wins_and_is_what_the_selection_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls()

    def fast(*args: Any, **kwargs: Any) -> mx.array:
        calls.n += 1
        return paged_attention_ref(*args, **kwargs)

    # The reference made slow, so the (correct) kernel is the faster one.
    slow_op = dataclasses.replace(ATTENTION_OP, reference=slower, kernels={"cpu": Kernel(fast)})
    sel = select_kernels(SHAPES, ops=(slow_op,), timing_iters=2)
    assert sel.report.implementation("paged_attention") == "cpu"
    before = calls.n
    sel.paged_attention(*ATTENTION_OP.check_cases(SHAPES)[0].args, scale=0.1)
    assert calls.n == before + 1


def test_strict_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, raising)
    with pytest.raises(KernelCheckError, match="paged_attention.*cpu.*Unable to build"):
        select_kernels(SHAPES, "strict")


def test_ref_mode_and_env_force_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, raising)
    assert select_kernels(SHAPES, "ref").report.implementations()["paged_attention"] == "reference"
    monkeypatch.setenv("TRILLM_KERNELS", "ref")
    report = select_kernels(SHAPES).report
    assert report.backend is None and "TRILLM_KERNELS=ref" in report.ops[0].reason
    with pytest.raises(ValueError):
        select_kernels(SHAPES, "fast")


def test_unsupported_shapes_run_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(raising, lambda s: "head_dim 32 is too small"))
    sel = select_kernels(SHAPES)
    assert sel.report.implementation("paged_attention") == "reference" and "too small" in sel.report.ops[0].reason


def test_decisions_are_cached(monkeypatch: pytest.MonkeyPatch, _cache: Path) -> None:
    calls = Calls()

    def counted(*args: Any, **kwargs: Any) -> mx.array:
        calls.n += 1
        return slower(*args, **kwargs)

    _install(monkeypatch, counted)
    first = select_kernels(SHAPES, ops=(ATTENTION_OP,), timing_iters=1).report.ops[0]
    assert not first.cached and first.reason.endswith("slower than the reference")
    assert len(list(_cache.glob("*.json"))) == 1
    calls.n = 0
    second = select_kernels(SHAPES, ops=(ATTENTION_OP,), timing_iters=1).report.ops[0]
    assert second.cached and second.implementation == "reference" and calls.n == 0  # no check, no timing


def test_a_cached_failure_still_warns_and_strict_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, raising)
    with pytest.warns(KernelFallbackWarning):
        select_kernels(SHAPES)
    with pytest.warns(KernelFallbackWarning, match="cached result of an earlier start"):
        assert select_kernels(SHAPES).report.ops[0].cached
    with pytest.raises(KernelCheckError):
        select_kernels(SHAPES, "strict")


def test_the_cache_key_follows_the_kernel(monkeypatch: pytest.MonkeyPatch, _cache: Path) -> None:
    _install(monkeypatch, slower)
    select_kernels(SHAPES, ops=(ATTENTION_OP,), timing_iters=1)
    _install(monkeypatch, wrong)
    with pytest.warns(KernelFallbackWarning):  # not the cached "slower" decision: another kernel
        select_kernels(SHAPES, ops=(ATTENTION_OP,), timing_iters=1)
    assert len(list(_cache.glob("*.json"))) == 2


def test_the_shared_kernel_body_passes_the_self_check_in_the_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real Metal/CUDA body (via the g++ emulator) through every check case: B 1 and 9, L 1, 3 and chunk, splits."""
    kernel_emulator.install()
    _install(monkeypatch, lambda *a, **k: paged_attention_kernel(kernel_emulator.BACKEND, *a, **k))
    shapes = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=2, chunk=8, max_context=140)
    assert launch_plan(kernel_emulator.BACKEND, 1, 4, 2, 1, 32, 160).num_parts == 2  # the long row splits
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: (0.0, 1.0))  # the emulator is not a speed
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        report = select_kernels(shapes, "strict").report
    assert report.implementation("paged_attention") == "cpu", report


def test_command_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--preset", "smollm2-135m", "--dtype", "float32", "--max-batch", "2", "--chunk", "8"]
    assert selfcheck.main(args) == 0  # the CPU extension's paged attention passes its check
    _install(monkeypatch, wrong)
    out = tmp_path / "report.json"
    assert selfcheck.main([*args, "--json", str(out)]) == 1
    assert "check failed" in capsys.readouterr().out
    (entry,) = json.loads(out.read_text())
    assert entry["report"]["ops"][0]["failed"] is True


VARIANTS = dataclasses.replace(SHAPES, sinks=True, softcap=2.0, layer_windows=(5, None, 5))  # Gemma-2 + gpt-oss-like


def test_check_cases_cover_every_declared_variant() -> None:
    cases = ATTENTION_OP.check_cases(VARIANTS)
    windows = [c.kwargs["window"] for c in cases]
    assert set(windows) == {5, None} and windows[0] == 5  # each layer kind's window, the first one in full
    assert all(c.kwargs["softcap"] == 2.0 and c.kwargs["sinks"] is not None for c in cases)
    for window in (5, None):  # decode and prefill for both
        assert {c.args[0].shape[2] for c in cases if c.kwargs["window"] == window} == {1, 3, 8}
    plain = ATTENTION_OP.check_cases(SHAPES)
    assert all(c.kwargs["softcap"] is None and c.kwargs["sinks"] is None and c.kwargs["window"] is None for c in plain)
    timed = ATTENTION_OP.timing_cases(VARIANTS)
    assert all(c.kwargs["window"] is None for c in timed)  # full attention: the costlier layers


@pytest.mark.parametrize("dropped", ["softcap", "window", "sinks"])
def test_a_kernel_that_ignores_a_variant_falls_back(monkeypatch: pytest.MonkeyPatch, dropped: str) -> None:
    def ignoring(*args: Any, **kwargs: Any) -> mx.array:
        return paged_attention_ref(*args, **{**kwargs, dropped: None})

    _install(monkeypatch, ignoring)
    with pytest.warns(KernelFallbackWarning, match="exceeds atol"):
        sel = select_kernels(VARIANTS, ops=(ATTENTION_OP,))
    assert sel.report.implementation("paged_attention") == "reference"


def test_the_cpu_primitive_passes_the_variant_check() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        report = select_kernels(VARIANTS, "strict", ops=(ATTENTION_OP,), timing_iters=1).report
    assert report.ops[0].backend == "cpu" and not report.ops[0].failed, report


def test_the_shared_kernel_body_passes_the_variant_check_in_the_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_emulator.install()
    _install(monkeypatch, lambda *a, **k: paged_attention_kernel(kernel_emulator.BACKEND, *a, **k))
    shapes = dataclasses.replace(VARIANTS, max_batch=2, max_context=140)
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: (0.0, 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        report = select_kernels(shapes, "strict", ops=(ATTENTION_OP,)).report
    assert report.implementation("paged_attention") == "cpu", report
