"""Every CUDA kernel body compiles inside MLX's generated `__global__` wrapper (nvcc, sm_90).

Needs nvcc and MLX's CUDA device headers (`python -m trillm.kernels.tools.cuda_compile fetch` extracts them
from the mlx-cuda-13 wheel into ~/.cache/trillm/mlx-cuda-headers). Where nvcc exists and the headers do
not, the first test fetches them (pip download, ~90 MB, a few seconds from PyPI; TRILLM_FETCH_CUDA_HEADERS=0
turns that off); a failed fetch skips with the reason instead of failing.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels.kv_gather import GATHER
from trillm.kernels.tools import cuda_compile as cc

pytestmark = pytest.mark.skipif(not cc.nvcc_present(), reason=f"nvcc not found at {cc.NVCC} (set NVCC=...)")


@pytest.fixture(scope="module", autouse=True)
def _headers() -> None:
    if cc.headers_present():
        return
    missing = f"MLX CUDA device headers missing in {cc.HEADER_DIR}: run `python -m trillm.kernels.tools.cuda_compile fetch`"
    if os.environ.get("TRILLM_FETCH_CUDA_HEADERS", "1") == "0":
        pytest.skip(missing)
    try:
        cc.fetch_headers()
    except Exception as exc:  # noqa: BLE001  (no network, no wheel, unexpected wheel layout: all mean skip)
        pytest.skip(f"{missing} (automatic fetch failed: {exc})")


def test_wrapper_matches_mlx_layout() -> None:
    """Spot-check the reconstructed signature against MLX 0.32.4's build_kernel text."""
    v = next(v for v in cc.all_variants() if v.spec == GATHER and v.input_dtypes[0] == mx.float16)
    src = cc.wrapper_source(v)
    assert src.startswith('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n')
    assert "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n__global__ void custom_kernel_" in src
    assert "    const __half* pool,\n    const int32_t* block_tables,\n    const int32_t* meta,\n    __half* out) {\n" in src
    assert "  using T = __half;\n  constexpr int BS = 32;\n" in src
    assert src.endswith("\n}\n\n} // namespace mlx::core::cu\n")


def test_all_cuda_kernels_compile() -> None:
    failed = cc.compile_together(cc.all_variants())
    assert failed is None, f"{failed.variant.spec.name} failed to compile:\n{failed.log}"


def test_broken_body_fails() -> None:
    """The check has teeth: an undefined identifier in a body is reported."""
    v = next(v for v in cc.all_variants() if v.spec == GATHER)
    broken = dataclasses.replace(v, spec=dataclasses.replace(v.spec, body=v.spec.body.replace("max_len", "max_lem", 1)))
    ok, log = cc.compile_source(cc.wrapper_source(broken))
    assert not ok and "max_len" in log
