"""Which implementation an op runs: a custom kernel on Metal or CUDA, else the pure-mx reference."""

from __future__ import annotations

import os
from typing import Literal

import mlx.core as mx

Backend = Literal["metal", "cuda"]

FORCE_REF_ENV = "TRILLM_KERNELS"  # TRILLM_KERNELS=ref forces the references everywhere


def cuda_available() -> bool:
    """True when this MLX build has a usable CUDA back-end (mx.cuda exists in 0.32.4; guard older builds)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def kernel_backend() -> Backend | None:
    """The kernel back-end for the current default device, or None to run the reference.

    Read on every call (cheap), so a test or the engine can switch device or env at run time.
    """
    if os.environ.get(FORCE_REF_ENV, "").lower() == "ref":
        return None
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if cuda_available():
        return "cuda"
    return None
