"""The engine's start-up kernel self-check, with the back-end mocked: whatever the kernel does, the engine serves.

A mock registered as the "cpu" paged attention kernel travels the real path: the engine's self-check on the
model's shapes, the fallback, the report, and (when chosen) every forward of the engine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from test_engine import GREEDY, engine, mlx_lm_greedy, prompts
from trillm.engine.config import EngineConfig, add_engine_arguments, engine_config_from_args
from trillm.engine.errors import InvalidRequest, ModelLoadError
from trillm.engine.loader import LoadedModel
from trillm.kernels import selfcheck
from trillm.kernels.backend import Kernel
from trillm.kernels.paged_attention import KERNELS, paged_attention_ref
from trillm.kernels.selfcheck import CACHE_ENV, KernelFallbackWarning


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)


class Mock:
    """A paged attention "kernel": `kind` is raise, wrong, slow or good; counts its calls."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        self.calls += 1
        if self.kind == "raise":
            raise RuntimeError("[metal::Device] Unable to build metal library from source")
        out = paged_attention_ref(*args, **kwargs)
        if self.kind == "wrong":
            return out * 1.5
        if self.kind == "slow":
            mx.eval(out)
            time.sleep(0.02)  # far beyond timing noise
        return out


def _serve(model: LoadedModel, mock: Mock, **config: Any) -> tuple[Any, list[list[int]], int]:
    """(engine, greedy outputs of three prompts, the mock's calls during the start-up check)."""
    eng = engine(model, **config)
    checked = mock.calls
    return eng, [list(o.new_token_ids) for o in eng.generate(prompts(model)[:3], GREEDY)], checked


@pytest.mark.parametrize("kind", ["raise", "wrong", "slow"])
def test_a_bad_kernel_falls_back_and_the_engine_serves(kind: str, tiny_model: LoadedModel,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    mock = Mock(kind)
    monkeypatch.setitem(KERNELS, "cpu", Kernel(mock))
    if kind == "slow":
        eng, outs, checked = _serve(tiny_model, mock)
    else:
        with pytest.warns(KernelFallbackWarning, match="paged_attention: the cpu kernel failed"):
            eng, outs, checked = _serve(tiny_model, mock)
    report = eng.kernel_report
    assert report is not None and report.implementation("paged_attention") == "reference"
    assert report.ops[0].failed == (kind != "slow") and checked > 0
    assert outs == [mlx_lm_greedy(tiny_model, p, GREEDY.max_tokens) for p in prompts(tiny_model)[:3]]
    assert mock.calls == checked  # serving never called the rejected kernel


def test_a_good_kernel_is_what_the_engine_runs(tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    mock = Mock("good")
    monkeypatch.setitem(KERNELS, "cpu", Kernel(mock))
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: (1.0, 2.0))  # as if faster than the reference
    eng, outs, checked = _serve(tiny_model, mock)
    assert eng.kernel_report is not None and eng.kernel_report.implementation("paged_attention") == "cpu"
    assert outs == [mlx_lm_greedy(tiny_model, p, GREEDY.max_tokens) for p in prompts(tiny_model)[:3]]
    assert mock.calls > checked  # every forward's attention went through it


def test_strict_fails_at_start(tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KERNELS, "cpu", Kernel(Mock("wrong")))
    with pytest.raises(ModelLoadError, match="--kernels strict: paged_attention"):
        engine(tiny_model, kernels="strict")


def test_ref_runs_no_kernel(tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    mock = Mock("raise")
    monkeypatch.setitem(KERNELS, "cpu", Kernel(mock))
    eng, outs, _ = _serve(tiny_model, mock, kernels="ref")
    assert mock.calls == 0 and eng.kernel_report is not None and eng.kernel_report.mode == "ref"
    assert outs[0] == mlx_lm_greedy(tiny_model, prompts(tiny_model)[0], GREEDY.max_tokens)


def test_the_cpu_kernel_is_checked_and_serves_like_the_reference(tiny_model: LoadedModel) -> None:
    from trillm.kernels import cpu_ext

    eng = engine(tiny_model)
    report = eng.kernel_report
    assert report is not None and report.implementation("kv_gather") == "reference"  # no CPU kernel for it
    (attn,) = [r for r in report.ops if r.op == "paged_attention"]
    if cpu_ext.status().available:
        assert attn.backend == "cpu" and not attn.failed and attn.kernel_ms is not None, attn
    else:
        assert attn.implementation == "reference"
    ps = prompts(tiny_model)
    got = [list(o.new_token_ids) for o in eng.generate(ps[:2], GREEDY)]
    assert got == [mlx_lm_greedy(tiny_model, p, GREEDY.max_tokens) for p in ps[:2]]


def test_the_kernels_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).kernels == "auto"
    assert engine_config_from_args(parser.parse_args(["--kernels", "strict"])).kernels == "strict"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kernels", "fast"])
    with pytest.raises(InvalidRequest):
        EngineConfig(kernels="fast")


OTHER_OPS = {op.name: op for op in selfcheck.ENGINE_OPS if op.name in ("rms_norm", "rope", "silu_mul", "linear")}


@pytest.mark.parametrize("name", sorted(OTHER_OPS))
@pytest.mark.parametrize("kind", ["raise", "wrong"])
def test_each_op_falls_back_alone_and_the_engine_serves(name: str, kind: str, tiny_model: LoadedModel,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A broken build or wrong numbers in one op: that op runs its reference, with one warning naming it; the
    others keep their kernels; the engine serves mlx-lm's tokens."""
    op = OTHER_OPS[name]
    calls = Calls()

    def broken(*args: Any, **kwargs: Any) -> mx.array:
        calls.n += 1
        if kind == "raise":
            raise RuntimeError("trillm's CPU extension is unavailable: the build failed")
        return op.reference(*args, **kwargs) * 1.5

    monkeypatch.setitem(op.kernels, "cpu", Kernel(broken))
    with pytest.warns(KernelFallbackWarning) as caught:
        eng = engine(tiny_model)
    assert [str(w.message).split(":")[0] for w in caught] == [name]
    report = eng.kernel_report
    assert report is not None and report.implementation(name) == "reference"
    assert [r.op for r in report.ops if r.failed] == [name]  # the others passed (kept unless slower)
    checked = calls.n
    ps = prompts(tiny_model)[:2]
    got = [list(o.new_token_ids) for o in eng.generate(ps, GREEDY)]
    assert got == [mlx_lm_greedy(tiny_model, p, GREEDY.max_tokens) for p in ps]
    assert calls.n == checked  # serving never called the rejected kernel


class Calls:
    def __init__(self) -> None:
        self.n = 0
