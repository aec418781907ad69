"""The optimized BLAS is loaded before mlx and really serves its matmuls; if not, a warning names the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trillm.kernels import BLAS


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload is for the Linux mlx[cpu] wheel")
def test_blas_serves_mlx_when_trillm_comes_first() -> None:
    if BLAS.name == "reference":
        pytest.skip("no optimized BLAS installed on this machine (dev.sh installs libopenblas0-pthread)")
    out = _run("import trillm.kernels as k, mlx.core as mx; from trillm.kernels._blas import cblas_provider;"
               "a = mx.ones((64, 64)); mx.eval(a @ a); print(k.BLAS.effective, cblas_provider())")
    assert out.returncode == 0, out.stderr
    effective, provider = out.stdout.split()
    assert effective == "True"
    assert "openblas" in provider or "mkl" in provider


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload is for the Linux mlx[cpu] wheel")
def test_warns_once_with_the_fix_when_mlx_came_first() -> None:
    out = _run("import mlx.core; import trillm.kernels as k; print(k.BLAS.effective)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    assert out.stderr.count("UserWarning") == 1 and ("libopenblas0-pthread" in out.stderr)
