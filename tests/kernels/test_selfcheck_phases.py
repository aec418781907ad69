"""The self-check decides per phase, keeps only deterministic failures for good, and syncs after each case.

As test_selfcheck.py: the CPU back-end's registry slot holds a mock, so the real path runs (check, timing,
decision, cache, the selection's routing).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import rms_norm as rms_norm_op
from trillm.kernels import selfcheck
from trillm.kernels.backend import Kernel
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import KERNELS as ATTENTION_KERNELS
from trillm.kernels.paged_attention import OP as ATTENTION_OP
from trillm.kernels.paged_attention import paged_attention_ref
from trillm.kernels.selfcheck import CACHE_ENV, KernelFallbackWarning, select_kernels

SHAPES = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=4, chunk=8, max_context=256)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)
    return tmp_path / "kernel-cache"


class Counting:
    """The reference, counting its calls by phase."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: dict[str, int] = {"decode": 0, "prefill": 0}
        self.fail = fail

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        self.calls["decode" if args[0].shape[2] == 1 else "prefill"] += 1
        if self.fail == "raise":
            raise RuntimeError("[cuda] out of memory")
        out = paged_attention_ref(*args, **kwargs)
        return out + 0.5 if self.fail == "wrong" else out


def _install(monkeypatch: pytest.MonkeyPatch, fn: Any) -> None:
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(fn))


def _args(num_queries: int) -> tuple[Any, ...]:
    case = next(c for c in ATTENTION_OP.check_cases(SHAPES) if c.args[0].shape[2] == num_queries)
    return case.args, dict(case.kwargs)


def test_a_faster_decode_kernel_survives_a_slower_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Summed, 1 + 10 ms against 4 + 5 ms would discard the kernel; per phase, decode keeps it."""
    kernel = Counting()
    _install(monkeypatch, kernel)
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: {"decode": (1.0, 4.0), "prefill": (10.0, 5.0)})
    for cached in (False, True):
        selection = select_kernels(SHAPES, ops=(ATTENTION_OP,))
        (r,) = selection.report.ops
        assert (r.implementation, r.phases, r.cached) == ("cpu", (("decode", "cpu"), ("prefill", "reference")), cached)
        assert "decode: cpu" in r.reason and "prefill: reference" in r.reason
        before = dict(kernel.calls)
        for n in (1, 3):
            args, kwargs = _args(n)
            got = selection.paged_attention(*args, **kwargs)
            assert mx.allclose(got, paged_attention_ref(*args, **kwargs)).item()
        assert kernel.calls["decode"] == before["decode"] + 1  # decode calls run the kernel
        assert kernel.calls["prefill"] == before["prefill"]  # prefill calls run the reference


@pytest.mark.parametrize("timings, implementation", [
    ({"decode": (1.0, 4.0), "prefill": (5.0, 5.1)}, "cpu"), ({"decode": (5.0, 4.0), "prefill": (9.0, 5.0)}, "reference"),
])  # fmt: skip
def test_when_the_phases_agree_one_implementation_runs(monkeypatch: pytest.MonkeyPatch, timings: Any,
                                                       implementation: str) -> None:  # fmt: skip
    _install(monkeypatch, Counting())
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: timings)
    (r,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    assert r.implementation == implementation and r.phases is None


def test_timing_is_grouped_by_the_phase_of_each_case() -> None:
    ref = Kernel(paged_attention_ref)
    timed = selfcheck.time_kernel(ATTENTION_OP, ref, SHAPES, 1)
    assert isinstance(timed, dict) and set(timed) == {"decode", "prefill"}
    norm = Kernel(rms_norm_op.OP.reference)
    timed = selfcheck.time_kernel(rms_norm_op.OP, norm, SHAPES, 1)
    assert isinstance(timed, dict) and set(timed) == {"all"}  # no phase_of: one decision, as before


def test_a_failure_that_raised_expires_and_is_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = Counting("raise")
    _install(monkeypatch, kernel)
    with pytest.warns(KernelFallbackWarning):
        (r,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    assert r.failed and r.expires_at is not None and r.expires_at > time.time() + selfcheck.FAILURE_TTL_S - 60
    calls = sum(kernel.calls.values())
    with pytest.warns(KernelFallbackWarning, match="cached result"):
        assert select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops[0].cached  # within the TTL: cached
    assert sum(kernel.calls.values()) == calls
    later = time.time() + selfcheck.FAILURE_TTL_S + 1
    monkeypatch.setattr(selfcheck.time, "time", lambda: later)
    with pytest.warns(KernelFallbackWarning):
        (r,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    assert not r.cached and sum(kernel.calls.values()) > calls  # checked again


def test_a_mismatch_stays_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = Counting("wrong")
    _install(monkeypatch, kernel)
    with pytest.warns(KernelFallbackWarning):
        (r,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    assert r.failed and r.expires_at is None
    calls = sum(kernel.calls.values())
    far = time.time() + 100 * selfcheck.FAILURE_TTL_S
    monkeypatch.setattr(selfcheck.time, "time", lambda: far)
    with pytest.warns(KernelFallbackWarning, match="cached result"):
        assert select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops[0].cached
    assert sum(kernel.calls.values()) == calls


def test_a_fault_at_the_sync_is_the_failing_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose error surfaces only when the device is waited for fails its own check case."""
    _install(monkeypatch, Counting())
    seen: list[int] = []

    def synchronize(*_: Any) -> None:
        seen.append(1)
        raise RuntimeError("[metal] command buffer execution failed")

    monkeypatch.setattr(selfcheck.mx, "synchronize", synchronize)
    with pytest.warns(KernelFallbackWarning, match="command buffer"):
        (r,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    first = ATTENTION_OP.check_cases(SHAPES)[0].label
    assert seen == [1] and r.reason.startswith(f"check failed: {first}: RuntimeError") and r.expires_at is not None
