"""Offline CUDA compile check: rebuild MLX's generated `__global__` wrapper and compile it with nvcc.

MLX (0.32.4, mlx/backend/cuda/custom_kernel.cpp) JIT-compiles a `cuda_kernel` body with NVRTC inside

    <default header: #include "mlx/backend/cuda/device/utils.cuh", <cooperative_groups.h>, #define inf ...>
    <our header>
    namespace mlx::core::cu {
    namespace cg = cooperative_groups;
    __global__ void custom_kernel_<name><hash>(const T* in, [const __grid_constant__ Shape in_shape, ...]
                                               ..., T* out) {
      constexpr int D = 64; using T = float; ...      // template arguments
      <body>
    }
    }

`wrapper_source` reproduces that text; `compile_source` runs `nvcc -std=c++17 -arch=sm_90 -c` on it.
MLX's device headers ship only as strings inside the mlx-cuda wheel's libmlx.so: `fetch_headers`
downloads that wheel (~90 MB, not installed) and extracts them into HEADER_DIR.

    python -m trillm.kernels.tools.cuda_compile fetch     # once: headers -> ~/.cache/trillm/mlx-cuda-headers
    python -m trillm.kernels.tools.cuda_compile check     # compile every CUDA kernel variant
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from trillm.kernels.backend import header_for
from trillm.kernels.tools.variants import TemplateArg, Variant, default_variants, template_decls

HEADER_DIR = Path(os.environ.get("TRILLM_MLX_CUDA_HEADERS", Path.home() / ".cache/trillm/mlx-cuda-headers"))
NVCC = os.environ.get("NVCC", shutil.which("nvcc") or "/usr/local/bin/nvcc")
_DEVICE = "mlx/backend/cuda/device"
# A marker that identifies each header we need among the strings embedded in libmlx.so.
_HEADER_MARKERS = {
    "utils.cuh": "using Shape = cuda::std::array",
    "complex.cuh": "using complex64_t = complex_t<float>",
    "config.h": "#define MAX_NDIM",
}
_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""
_CUDA_TYPES = {
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double",
}  # fmt: skip


def headers_present(header_dir: Path = HEADER_DIR) -> bool:
    """True when the extracted MLX device headers are in `header_dir`."""
    return all((header_dir / _DEVICE / name).is_file() for name in _HEADER_MARKERS)


def nvcc_present() -> bool:
    return Path(NVCC).is_file() and os.access(NVCC, os.X_OK)


def extract_headers(libmlx: bytes, header_dir: Path) -> list[Path]:
    """Find the NUL-terminated header texts embedded in libmlx.so and write them under header_dir."""
    written = []
    for name, marker in _HEADER_MARKERS.items():
        at = libmlx.find(marker.encode())
        if at < 0:
            raise RuntimeError(f"{name} not found in libmlx.so (marker {marker!r})")
        start = libmlx.rfind(b"\0", 0, at) + 1
        text = libmlx[start : libmlx.find(b"\0", at)].decode("utf-8", "replace")
        path = header_dir / _DEVICE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def fetch_headers(header_dir: Path = HEADER_DIR, version: str = str(getattr(mx, "__version__", ""))) -> list[Path]:
    """Download the mlx-cuda-13 wheel (not installed; ~90 MB) and extract its device headers."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"mlx-cuda-13=={version}", "-d", tmp]
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("mlx_cuda_13-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            libmlx = zf.read("mlx/lib/libmlx.so")
    return extract_headers(libmlx, header_dir)


def _template_hash(template: list[TemplateArg]) -> str:
    parts = []
    for _, arg in template:
        if isinstance(arg, bool):
            parts.append("_t" if arg else "_f")
        elif isinstance(arg, int):
            parts.append(f"_{arg}")
        else:
            parts.append("_" + _CUDA_TYPES[arg])
    return "".join(parts)


def wrapper_source(v: Variant) -> str:
    """The translation unit MLX's CUDA custom_kernel builds for `v` (inputs all have ndim > 0)."""
    spec = v.spec
    lines = [_DEFAULT_HEADER, header_for("cuda", spec), "namespace mlx::core::cu {\n\n", "namespace cg = cooperative_groups;\n\n"]
    lines.append(f"__global__ void custom_kernel_trillm_{spec.name}{_template_hash(list(v.template))}(\n")
    for name, dtype in zip(spec.input_names, v.input_dtypes):
        lines.append(f"    const {_CUDA_TYPES[dtype]}* {name},\n")
        for suffix, ctype in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if name + suffix in spec.body:  # MLX adds these only when the body names them
                lines.append(f"    const __grid_constant__ {ctype} {name}{suffix},\n")
    outs = [f"    {_CUDA_TYPES[dt]}* {name}" for name, dt in zip(spec.output_names, v.output_dtypes)]
    lines.append(",\n".join(outs) + ") {\n")
    lines += [decl + "\n" for decl in template_decls(v.template, _CUDA_TYPES)]
    if v.template:
        lines.append("\n")
    lines.append(spec.body)
    lines.append("\n}\n\n} // namespace mlx::core::cu\n")
    return "".join(lines)


@dataclass(frozen=True, slots=True)
class CompileResult:
    variant: Variant
    ok: bool
    log: str


def compile_source(source: str, header_dir: Path = HEADER_DIR, arch: str = "sm_90") -> tuple[bool, str]:
    """nvcc -std=c++17 -arch=<arch> -c on one translation unit; returns (ok, compiler output)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        cmd = [NVCC, "-std=c++17", f"-arch={arch}", "-c", str(src), "-o", str(Path(tmp) / "kernel.o"),
               f"-I{header_dir}", "-Werror", "all-warnings"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0, proc.stdout + proc.stderr


def compile_variants(variants: list[Variant], header_dir: Path = HEADER_DIR, jobs: int = 2) -> list[CompileResult]:
    """Compile every variant (in parallel, `jobs` at a time)."""
    def one(v: Variant) -> CompileResult:
        ok, log = compile_source(wrapper_source(v), header_dir)
        return CompileResult(v, ok, log)

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, variants))


def all_variants() -> list[Variant]:
    """The variants the default shapes launch on CUDA (see variants.DEFAULT_SHAPES), recorded from the launch code.

    CUDA has no `constant` address space: variants that differ only there are one kernel.
    """
    seen: dict[tuple[object, ...], Variant] = {}
    for v in default_variants("cuda"):
        seen.setdefault((v.spec, v.input_dtypes, v.output_dtypes, v.template), v)
    return list(seen.values())


def compile_together(variants: list[Variant], header_dir: Path = HEADER_DIR) -> CompileResult | None:
    """Compile all variants as one translation unit (one header parse: ~5x faster than one TU each).

    Each wrapper is MLX's text unchanged; the CUDA prelude's include guard lets them share a file.
    Returns None when everything compiled, else the first failing variant with the compiler log.
    """
    sources = [wrapper_source(v) for v in variants]
    ok, log = compile_source("\n".join(sources), header_dir)
    if ok:
        return None
    first = re.search(r"kernel\.cu\((\d+)\)", log)
    line, offset = int(first.group(1)) if first else 0, 0
    for v, src in zip(variants, sources):
        offset += src.count("\n") + 1
        if line <= offset:
            return CompileResult(v, False, log)
    return CompileResult(variants[-1], False, log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trillm.kernels.tools.cuda_compile", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["fetch", "check", "source"])
    parser.add_argument("--header-dir", type=Path, default=HEADER_DIR)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--together", action="store_true", help="one translation unit for all kernels")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        for path in fetch_headers(args.header_dir):
            print(path)
        return 0
    if args.command == "source":
        print(wrapper_source(all_variants()[0]))
        return 0
    if not nvcc_present() or not headers_present(args.header_dir):
        print(f"need nvcc ({NVCC}) and headers in {args.header_dir} (run `fetch`)", file=sys.stderr)
        return 2
    if args.together:
        failed = compile_together(all_variants(), args.header_dir)
        print("ok" if failed is None else f"FAIL {failed.variant.spec.name}\n{failed.log}")
        return 0 if failed is None else 1
    results = compile_variants(all_variants(), args.header_dir, args.jobs)
    for r in results:
        print(("ok  " if r.ok else "FAIL") + f" {r.variant.spec.name} {_template_hash(list(r.variant.template))}")
        if not r.ok:
            print(r.log)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
