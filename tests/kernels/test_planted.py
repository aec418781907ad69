"""The planted-failure checks of the GPU check, through the g++ kernel emulator (no GPU here).

On a GPU the same code plants into Metal/CUDA; here it proves the plants themselves have teeth: a compile
error raises, a wrong scale mismatches, both fall back, and a plant that changes nothing is reported.
"""

from __future__ import annotations

import shutil

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)

import kernel_emulator
from trillm.kernels.backend import kernel_backend
from trillm.kernels.paged_attention import ATTN_FINAL, ATTN_PARTIAL
from trillm.kernels.tools import planted

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")


def _run(plant: planted.Plant) -> list[str]:
    key = kernel_backend()
    assert key is not None
    return planted.run_plant(plant, "emulate", kernel_emulator.emulator_factory, kernel_emulator.HOST_PRELUDE, key)


def test_the_plant_site_is_in_both_main_bodies() -> None:
    assert planted.PLANT_SITE in ATTN_FINAL.body and planted.PLANT_SITE in ATTN_PARTIAL.body


@pytest.mark.parametrize("name", sorted(planted.PLANTS))
def test_each_plant_is_caught_and_falls_back(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(planted.PLANTS[name]) == []
    out = capsys.readouterr().out
    assert "2. select_kernels: reference (check failed" in out and "1 fallback warning(s)" in out
    assert ("raised RuntimeError" in out) == planted.PLANTS[name].raises


def test_a_plant_that_changes_nothing_is_a_finding() -> None:
    problems = _run(planted.Plant("noop", planted.PLANT_SITE, False))
    assert any("matched the reference" in p for p in problems)
    assert any("did not fall back" in p for p in problems)


def test_without_a_gpu_the_command_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if kernel_backend() in ("metal", "cuda"):
        pytest.skip("a GPU is here")
    assert planted.main(["compile"]) == 2
    assert "no GPU back-end" in capsys.readouterr().err
