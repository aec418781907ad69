"""The first check of a new cache key runs in a child process: a kernel that kills its process sets itself aside.

On Metal a command-buffer fault can abort the process instead of raising; the self-check must survive it. The
child path is forced here on the CPU back-end (TRILLM_KERNEL_ISOLATE=1 or `isolate=True`) with planted
kernels (selfcheck_plants.py) that segfault, abort, exit or hang in the child, and ones that pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

import selfcheck_plants as plants
from trillm.kernels import selfcheck
from trillm.kernels.backend import Kernel
from trillm.kernels.kv_gather import KERNELS as GATHER_KERNELS
from trillm.kernels.kv_gather import OP as GATHER_OP
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import KERNELS as ATTENTION_KERNELS
from trillm.kernels.paged_attention import OP as ATTENTION_OP
from trillm.kernels.paged_attention import paged_attention_ref
from trillm.kernels.selfcheck import CACHE_ENV, ISOLATE_ENV, KernelFallbackWarning, select_kernels

SHAPES = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=4, chunk=8, max_context=256)


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)
    monkeypatch.setenv(ISOLATE_ENV, "1")
    monkeypatch.setenv(plants.PARENT_ENV, str(os.getpid()))
    monkeypatch.setenv(plants.LOG_ENV, str(tmp_path / "calls.log"))
    # The timing pass is not under test: a tie, so a kernel that passed its checks is chosen.
    monkeypatch.setattr(selfcheck, "time_kernel", lambda *a: (1.0, 1.0))


class Children:
    """Counts the child processes the self-check starts (it starts them with subprocess.run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = subprocess.run

        def run(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(selfcheck.subprocess, "run", run)


def _calls(tmp_path: Path) -> list[tuple[str, bool]]:
    """(kernel, whether it ran in a child) for each call logged."""
    log = tmp_path / "calls.log"
    lines = log.read_text().split() if log.exists() else []
    return [(name, int(pid) != os.getpid()) for name, pid in zip(lines[::2], lines[1::2])]


def _cached(cache: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(cache.glob("*.json"))]


@pytest.mark.parametrize("plant, death", [(plants.segfaults, "killed by SIGSEGV"), (plants.aborts, "killed by SIGABRT"),
                                          (plants.exits, "exited with status 3")])  # fmt: skip
def test_a_kernel_that_kills_the_child_is_set_aside(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plant: Any,
                                                    death: str) -> None:  # fmt: skip
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(plant))
    children = Children(monkeypatch)
    with pytest.warns(KernelFallbackWarning) as caught:
        sel = select_kernels(SHAPES, ops=(ATTENTION_OP,))
    # The parent survived, and says what happened, once, naming the case the child died in.
    first_case = ATTENTION_OP.check_cases(SHAPES)[0].label
    assert len(caught) == 1 and f"{first_case}: the check's child process was {death}".replace("was exited", "exited") \
        in str(caught[0].message)
    (r,) = sel.report.ops
    assert r.implementation == "reference" and r.failed and death in r.reason
    assert sel.paged_attention is paged_attention_ref
    assert children.n == 1
    assert _calls(tmp_path) == [(plant.__name__, True)]  # once, in the child; never here
    # Cached as a failure that raised: expires after the TTL, then the key is checked again.
    (entry,) = _cached(tmp_path / "kernel-cache")
    assert entry["failed"] and abs(entry["expires_at"] - (time.time() + selfcheck.FAILURE_TTL_S)) < 60
    with pytest.warns(KernelFallbackWarning, match="cached result of an earlier start"):
        (again,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    assert again.cached and again.implementation == "reference" and children.n == 1


def test_a_child_that_hangs_is_killed_at_the_timeout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(plants.hangs))
    monkeypatch.setattr(selfcheck, "CHILD_TIMEOUT_S", 8.0)
    t0 = time.monotonic()
    with pytest.warns(KernelFallbackWarning, match="did not finish within 8 s"):
        (r,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    assert time.monotonic() - t0 < 30
    assert r.failed and r.expires_at is not None and _calls(tmp_path) == [("hangs", True)]


def test_a_kernel_that_passes_in_the_child_is_then_checked_and_used_here(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(plants.passes))
    monkeypatch.setitem(GATHER_KERNELS, "cpu", Kernel(plants.gather_passes))
    children = Children(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        sel = select_kernels(SHAPES, ops=(ATTENTION_OP, GATHER_OP))
    assert sel.report.implementations() == {"paged_attention": "cpu", "kv_gather": "cpu"}
    assert sel.paged_attention is plants.passes and sel.kv_gather is plants.gather_passes
    assert children.n == 1  # one child for every op with an uncached key, not one per op or per case
    calls = _calls(tmp_path)
    cases = len(ATTENTION_OP.check_cases(SHAPES))
    # every check case in the child first, then again here (which compiles the variants serving will launch)
    assert calls[:cases] == [("passes", True)] * cases and ("passes", False) in calls
    assert calls.index(("passes", False)) > calls.index(("gather_passes", True))
    # The kernel decision is cached: the next start checks in-process only (no child), skips the timing.
    (tmp_path / "calls.log").unlink()
    sel = select_kernels(SHAPES, ops=(ATTENTION_OP, GATHER_OP))
    assert all(r.cached for r in sel.report.ops) and sel.report.implementation("paged_attention") == "cpu"
    assert children.n == 1 and {in_child for _, in_child in _calls(tmp_path)} == {False}


def test_after_a_crash_a_new_child_checks_the_remaining_ops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(plants.aborts))
    monkeypatch.setitem(GATHER_KERNELS, "cpu", Kernel(plants.gather_passes))
    children = Children(monkeypatch)
    with pytest.warns(KernelFallbackWarning) as caught:
        sel = select_kernels(SHAPES, ops=(ATTENTION_OP, GATHER_OP))
    assert len(caught) == 1 and "paged_attention" in str(caught[0].message)
    assert sel.report.implementations() == {"paged_attention": "reference", "kv_gather": "cpu"}
    assert children.n == 2
    assert ("gather_passes", True) in _calls(tmp_path) and ("gather_passes", False) in _calls(tmp_path)


def test_a_mismatch_in_the_child_is_a_deterministic_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(plants.wrong))
    with pytest.warns(KernelFallbackWarning, match="exceeds atol"):
        (r,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    assert r.failed and r.expires_at is None  # kept until the sources change
    assert _calls(tmp_path) == [("wrong", True)]  # the parent did not repeat it


def test_on_cpu_the_check_stays_in_process_unless_forced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ISOLATE_ENV)
    assert selfcheck.isolating("metal") and selfcheck.isolating("cuda") and not selfcheck.isolating("cpu")
    assert not selfcheck.isolating("metal", isolate=False) and selfcheck.isolating("cpu", isolate=True)
    monkeypatch.setenv(ISOLATE_ENV, "0")
    assert not selfcheck.isolating("metal")
    monkeypatch.delenv(ISOLATE_ENV)
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(plants.passes))
    children = Children(monkeypatch)
    assert select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.implementation("paged_attention") == "cpu"
    assert children.n == 0 and {c for _, c in _calls(tmp_path)} == {False}


def test_a_kernel_a_child_cannot_import_is_checked_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lambda (planted.py's kernels, test mocks) has no name to import: no child, the in-process check."""
    calls = []
    kernel = Kernel(lambda *a, **k: calls.append(1) or paged_attention_ref(*a, **k))
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", kernel)
    children = Children(monkeypatch)
    assert select_kernels(SHAPES, ops=(ATTENTION_OP,), isolate=True).report.implementation("paged_attention") == "cpu"
    assert children.n == 0 and calls


@pytest.mark.parametrize("shapes", [
    SHAPES, ModelShapes(8, 4, 256, 16, mx.bfloat16, softcap=50.0, layer_windows=(4096, None), max_batch=3),
    ModelShapes(64, 8, 64, 32, mx.float16, window=128, sinks=True, hidden_size=2880, vocab_size=201088),
    ModelShapes(16, 1, 512, 16, mx.float32, kv_lora_rank=512, qk_rope_head_dim=64),
])  # fmt: skip
def test_shapes_reach_the_child_unchanged(shapes: ModelShapes) -> None:
    wire = json.loads(json.dumps(selfcheck._shapes_json(shapes)))
    assert selfcheck._shapes_from_json(wire) == shapes


def test_every_gpu_kernel_can_be_checked_in_a_child() -> None:
    """A Metal/CUDA kernel registered as a lambda would silently skip the child: every one has a name."""
    gpu = [(op, k) for op in selfcheck.ENGINE_OPS for b, k in op.kernels.items() if b in ("metal", "cuda")]
    assert len(gpu) >= 6 and all(selfcheck._isolatable(op, k) for op, k in gpu)


def test_the_log_says_why_a_first_start_pauses_and_what_runs(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(plants.passes))
    with caplog.at_level("INFO", logger="trillm.kernels.selfcheck"):
        select_kernels(SHAPES, ops=(ATTENTION_OP, GATHER_OP))
        first = caplog.messages[:]
        caplog.clear()
        select_kernels(SHAPES, ops=(ATTENTION_OP, GATHER_OP))
    assert len(first) == 2
    assert "no cached decision for paged_attention on these shapes" in first[0]
    assert "in a child process first" in first[0]
    assert first[1].startswith("kernel self-check on cpu (") and first[1].endswith(
        "paged_attention=cpu, kv_gather=reference")  # the gather has no cpu kernel: nothing to check
    (again,) = caplog.messages  # a cached start: no pause announced
    assert again.endswith("paged_attention=cpu (cached), kv_gather=reference")


def test_the_summary_names_each_phase() -> None:
    ops = (selfcheck.OpReport("paged_attention", "metal", "metal", "checked per phase", phases=(
        ("decode", "metal"), ("prefill", "reference"))),  # fmt: skip
           selfcheck.OpReport("kv_gather", "reference", "metal", "check failed: x", failed=True, cached=True),
           selfcheck.OpReport("mla_attention", "reference", "metal", "not used by this model"))
    report = selfcheck.KernelReport("auto", "metal", "gpu", ops, 1.0)
    assert selfcheck.summary(report) == ("paged_attention=metal for decode, reference for prefill, "
                                         "kv_gather=reference (cached, failed)")


def test_a_child_that_dies_before_checking_leaves_the_check_to_this_process(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:  # fmt: skip
    """An environment where the child cannot start trillm is no kernel's fault: warn, check here as before."""
    monkeypatch.setattr(selfcheck, "_CHILD_CODE", "import sys; print('ModuleNotFoundError: mlx', file=sys.stderr); "
                                                  "sys.exit(1)")  # fmt: skip
    monkeypatch.setitem(ATTENTION_KERNELS, "cpu", Kernel(plants.passes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (r,) = select_kernels(SHAPES, ops=(ATTENTION_OP,)).report.ops
    assert r.implementation == "cpu" and not r.failed
    assert not [w for w in caught if issubclass(w.category, KernelFallbackWarning)]
    (w,) = [w for w in caught if "failed before it checked anything" in str(w.message)]
    assert "exited with status 1: ModuleNotFoundError: mlx" in str(w.message)
    assert {in_child for _, in_child in _calls(tmp_path)} == {False}
