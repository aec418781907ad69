"""Load an optimized CBLAS into the global symbol scope before `mlx` is first imported.

The `mlx[cpu]` Linux wheel links netlib's reference BLAS: fp32 matmul runs at ~5 GFLOP/s there, against
~300 with OpenBLAS. libmlx resolves `cblas_*` through the global scope first, so a library loaded earlier
with RTLD_GLOBAL serves every MLX matmul. MKL (pip `mkl`) is preferred when present: it reads weights
~2.6x faster than Debian's OpenBLAS 0.3.21 for one-row decode matmuls.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import warnings
from dataclasses import dataclass

_FIX = (
    "install OpenBLAS (`apt-get install -y libopenblas0-pthread`) or MKL (`pip install mkl`), "
    "and import trillm before mlx"
)


@dataclass(frozen=True, slots=True)
class BlasInfo:
    name: str  # "mkl", "openblas", "system" (macOS Accelerate / CUDA builds) or "reference"
    path: str | None
    effective: bool


def _candidates() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if override := os.environ.get("TRILLM_BLAS"):
        return [("custom", override)] if override not in ("none", "0") else []
    for lib in ("libmkl_rt.so.2", "libmkl_rt.so.3", "libmkl_rt.so"):
        path = os.path.join(sys.prefix, "lib", lib)
        if os.path.exists(path):
            found.append(("mkl", path))
            break
    for pattern in (
        "/usr/lib/*/openblas-pthread/libopenblas.so.0",
        "/usr/lib/*/libopenblas.so.0",
        "/usr/lib64/libopenblas*.so.0",
    ):
        found.extend(("openblas", p) for p in sorted(glob.glob(pattern)))
    return found


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def cblas_provider() -> str | None:
    """The file that serves `cblas_sgemm` in the global scope, the one libmlx binds to."""
    try:
        libc = ctypes.CDLL(None)
        addr = ctypes.cast(libc.cblas_sgemm, ctypes.c_void_p).value
        info = _DlInfo()
        if not libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)):
            return None
        return os.path.realpath(info.dli_fname.decode()) if info.dli_fname else None
    except (AttributeError, OSError, ValueError):
        return None


def _load() -> BlasInfo:
    if sys.platform != "linux":
        return BlasInfo("system", None, True)
    mlx_first = "mlx.core" in sys.modules
    for name, path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if mlx_first:
            warnings.warn(f"mlx was imported before trillm, so {path} cannot serve its matmuls; {_FIX}", stacklevel=3)
            return BlasInfo(name, path, False)
        provider = cblas_provider()
        if provider is not None and provider != os.path.realpath(path):
            warnings.warn(f"cblas_sgemm resolves to {provider}, not {path}; {_FIX}", stacklevel=3)
            return BlasInfo(name, path, False)
        return BlasInfo(name, path, True)
    warnings.warn(f"no optimized BLAS found: fp32 matmuls will run ~60x slower; {_FIX}", stacklevel=3)
    return BlasInfo("reference", None, False)


BLAS: BlasInfo = _load()
