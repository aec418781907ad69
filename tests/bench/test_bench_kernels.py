"""`trillm bench kernels`: points that would not fit the GPU's memory are skipped, not attempted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.bench import kernels as bk

GIB = 2**30


def test_the_budget_is_half_what_the_device_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bk.memory_budget_bytes() is None or mx.default_device() == mx.gpu  # CPU: no cap
    monkeypatch.setattr(bk.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(bk.mx, "device_info", lambda: {"max_recommended_working_set_size": 16 * GIB, "memory_size": 24 * GIB})
    assert bk.memory_budget_bytes() == 8 * GIB  # a 24 GB Mac
    monkeypatch.setattr(bk.mx, "device_info", lambda: {"free_memory": 140 * GIB, "total_memory": 143 * GIB})
    assert bk.memory_budget_bytes() == 70 * GIB  # an H200 (CUDA's keys)


def test_the_old_gpu_default_does_not_fit_a_mac() -> None:
    """B=64 x 32k of llama8b in f16 is 8 GiB of K/V; with the gathered copies it needs 32 GiB."""
    need = bk.point_bytes(64, 32768, bk.SHAPES["llama8b"], 16, mx.float16)
    assert need == 4 * 2 * 64 * 32768 * 8 * 128 * 2 and need > 8 * GIB


def test_points_over_the_budget_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRILLM_CPU_EXT", "0")
    small = bk.point_bytes(1, 512, bk.SHAPES["smollm2"], 16, mx.float32)
    args = ["--contexts", "512", "--batches", "1,4", "--iters", "1", "--peak-gbs", "1", "--no-decode-step",
            "--max-bytes", str(small), "--results", str(tmp_path)]  # fmt: skip
    assert bk.main(args) == 0
    (out,) = tmp_path.glob("kernels-*/bench_kernels.json")
    result = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in result["attention"]] == [(1, 512)]
    assert [(r["batch"], r["context"]) for r in result["skipped_for_memory"]] == [(4, 512)]
