"""Offline Metal compile check: every kernel variant's generated source, compiled outside MLX.

MLX (mlx/backend/common/metal_kernel.cpp) wraps a `metal_kernel` body as

    <our header>
    template <typename T, int D, ...>            // the template arguments
    [[kernel]] void custom_kernel_<name>_<template hash>_<input/output types>(
      const device T* q [[buffer(0)]],          // `constant` for inputs under 8 elements
      ...
      device T* out [[buffer(n)]],
      uint3 thread_position_in_grid [[thread_position_in_grid]], ...) {   // only attributes the body names
      <body>
    }
    template [[host_name("...")]] [[kernel]] decltype(...<float, 64, ...>) ...<float, 64, ...>;

and compiles MLX's utils header (`mlx/backend/metal/kernels/utils.h`, shipped in the mlx wheel) + that text.
`metal_source` rebuilds the text for a recorded variant (tools/variants.py).

    python -m trillm.kernels.tools.metal_compile check [--out DIR]   # macOS: MLX's own sources (verbose=True)
                                                                     # for every variant, xcrun metal -c each
    python -m trillm.kernels.tools.metal_compile standin             # anywhere: g++ type-checks the rebuilt
                                                                     # sources against a C++ stand-in header
    python -m trillm.kernels.tools.metal_compile sources --out DIR   # anywhere: write the rebuilt sources

`check` needs macOS with Xcode's command-line tools (`xcrun metal`); elsewhere it says so and exits 2. It also
diffs MLX's generated text against `metal_source`, so the stand-in check's input is verified on the first Mac.
The stand-in check is not Metal: it catches C++-level errors (undeclared names, a header that uses a thread
attribute, a missing `using namespace metal;`, template misuse), not Metal-specific ones.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx

from trillm.kernels import backend as kb
from trillm.kernels.layout import ModelShapes
from trillm.kernels.tools.variants import (
    DEFAULT_SHAPES, TemplateArg, Variant, all_dtypes, backend_installed, launch_check_cases, record,
)  # fmt: skip

METAL_TYPES: dict[mx.Dtype, str] = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float64: "double",
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}  # fmt: skip
UTILS_INCLUDE = '#include "mlx/backend/metal/kernels/utils.h"\n'
# MLX's utils.h uses `bfloat` (Metal 3.1); xcrun's default language version rejects it.
METAL_STD = "-std=metal3.1"
GXX = os.environ.get("CXX", shutil.which("g++") or "g++")

# Just enough of <metal_stdlib> and MLX's utils.h for g++ to type-check a generated kernel. Metal's names
# live in namespace metal, as on a Mac, so a prelude without `using namespace metal;` fails here too.
METAL_STANDIN = """
#include <cmath>
#include <cstddef>
#include <cstdint>
#define device
#define constant
#define threadgroup
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
typedef _Float16 float16_t;
struct bfloat16_t {
  float v;
  bfloat16_t() = default;
  bfloat16_t(float f) : v(f) {}
  operator float() const { return v; }
};
namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) {}
inline float simd_sum(float x) { return x; }
inline float simd_max(float x) { return x; }
inline float exp(float x) { return std::exp(x); }
inline float rint(float x) { return std::rint(x); }
namespace precise {
inline float divide(float a, float b) { return a / b; }
}  // namespace precise
}  // namespace metal
"""


def _template_text(template: Iterable[TemplateArg]) -> str:
    # MLX streams bools without std::boolalpha: 1 / 0.
    args = [str(int(a)) if isinstance(a, bool) else str(a) if isinstance(a, int) else METAL_TYPES[a] for _, a in template]
    return "<" + ", ".join(args) + ">"


def kernel_name(v: Variant) -> str:
    """MLX's name for the variant: template hash, then each input's type (+ "c" if constant), outputs' types."""
    name = f"custom_kernel_trillm_{v.spec.name}"
    if v.template:
        template_hash = _template_text(v.template).replace("<", "_").replace(">", "_").replace(", ", "_")
        name += "_" + template_hash[:-1]
    for dtype, ndim, const in zip(v.input_dtypes, v.input_ndims, v.constant_inputs):
        name += "_" + METAL_TYPES[dtype] + ("s" if ndim == 0 else "c" if const else "")
    return name + "".join("_" + METAL_TYPES[dt] for dt in v.output_dtypes)


def metal_source(v: Variant, prelude: str = kb.METAL_PRELUDE) -> str:
    """The text MLX compiles for `v` after its utils header (write_signature + the explicit instantiation)."""
    spec, name = v.spec, kernel_name(v)
    out = [prelude + spec.header]
    if v.template:
        kinds = ["bool" if isinstance(a, bool) else "int" if isinstance(a, int) else "typename" for _, a in v.template]
        out.append("template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, v.template)) + ">\n")
    out.append(f"[[kernel]] void {name}(\n")
    index = 0
    for arg, dtype, ndim, const in zip(spec.input_names, v.input_dtypes, v.input_ndims, v.constant_inputs):
        ref = "&" if ndim == 0 else "*"
        out.append(f"  const {'constant' if const else 'device'} {METAL_TYPES[dtype]}{ref} {arg} [[buffer({index})]],\n")
        index += 1
        if ndim > 0:
            for suffix, ctype in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                                  ("_ndim", "const constant int&")):  # fmt: skip
                if arg + suffix in spec.body:
                    out.append(f"  {ctype} {arg}{suffix} [[buffer({index})]],\n")
                    index += 1
    attributes = [f"  {kb.METAL_ATTRIBUTES[a]} {a} [[{a}]]" for a in kb.metal_attributes_in(spec.body)]
    last = len(spec.input_names) + len(spec.output_names) - 1
    for arg, dtype in zip(spec.output_names, v.output_dtypes):
        out.append(f"  device {METAL_TYPES[dtype]}* {arg} [[buffer({index})]]")
        out.append(",\n" if index < last or attributes else ") {\n")
        index += 1
    if attributes:
        out.append(",\n".join(attributes) + ") {\n")
    out.append(spec.body + "\n}\n")
    if v.template:
        full = name + _template_text(v.template)
        out.append(f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({full}) {full};\n')
    return "".join(out)


def standin_check(variants: list[Variant], prelude: str = kb.METAL_PRELUDE) -> tuple[bool, str]:
    """g++ -fsyntax-only on every rebuilt source (one translation unit) after the stand-in header."""
    text = METAL_STANDIN + "\n".join(metal_source(v, prelude) for v in variants)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(text)
        cmd = [GXX, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas", str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0, proc.stdout + proc.stderr


def xcrun_available() -> bool:
    return sys.platform == "darwin" and shutil.which("xcrun") is not None


def mlx_include_dir() -> Path:
    """The mlx wheel's header folder: site-packages/mlx/include (holds mlx/backend/metal/kernels/utils.h)."""
    import mlx

    return Path(next(iter(mlx.__path__))).resolve() / "include"


def _verbose_metal_factory(**kwargs: Any) -> Callable[..., Any]:
    kernel = kb.FACTORIES["metal"](**kwargs)
    return lambda **call: kernel(**call, verbose=True)


def mlx_generated_sources(shapes: Iterable[ModelShapes]) -> dict[str, str]:
    """MLX's own generated source per kernel name, printed by `verbose=True` calls (macOS with Metal only).

    Runs the self-check cases' launches without evaluating them: MLX prints at call time.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 1)
        try:
            with backend_installed("metal-verbose", _verbose_metal_factory, kb.METAL_PRELUDE, "metal"):
                launch_check_cases("metal-verbose", "metal", shapes)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        text = capture.read().decode("utf-8", "replace")
    sources = {}
    for block in re.findall(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```", text, re.S):
        found = re.search(r"\[\[kernel\]\] void (\w+)\(", block)
        if found:
            sources[found.group(1)] = block
    return sources


def xcrun_compile(source: str, out_dir: Path, name: str, flags: list[str]) -> tuple[bool, str]:
    """xcrun -sdk macosx metal -c on MLX's utils header + one kernel's source."""
    src = out_dir / f"{name}.metal"
    src.write_text(UTILS_INCLUDE + source)
    cmd = ["xcrun", "-sdk", "macosx", "metal", "-c", str(src), "-o", str(out_dir / f"{name}.air"),
           f"-I{mlx_include_dir()}", METAL_STD, *flags]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0, proc.stdout + proc.stderr


def check(out_dir: Path, shapes: list[ModelShapes], flags: list[str]) -> int:
    """macOS: dump MLX's source of every variant, diff it with `metal_source`, compile each with xcrun."""
    out_dir.mkdir(parents=True, exist_ok=True)
    generated = mlx_generated_sources(shapes)
    rebuilt = {kernel_name(v): metal_source(v) for v in record("metal", shapes)}
    print(f"{len(generated)} variants from MLX (verbose=True), {len(rebuilt)} rebuilt; sources in {out_dir}")
    failures = 0
    for name, source in sorted(generated.items()):
        ok, log = xcrun_compile(source, out_dir, name, flags)
        same = rebuilt.get(name) == source
        if not same:
            (out_dir / f"{name}.rebuilt.metal").write_text(rebuilt.get(name, "(no rebuilt variant of this name)\n"))
        print(f"{'ok  ' if ok else 'FAIL'} {name}{'' if same else '  (differs from metal_source: see .rebuilt.metal)'}")
        if not ok:
            failures += 1
            print(log)
    for name in sorted(set(rebuilt) - set(generated)):
        print(f"MISSING {name}: rebuilt here, never generated by MLX")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trillm.kernels.tools.metal_compile", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["check", "standin", "sources"])
    parser.add_argument("--out", type=Path, default=Path("results/metal-sources"))
    parser.add_argument("--all-dtypes", action="store_true", help="every default shape in f32, f16 and bf16")
    parser.add_argument("--metal-flag", action="append", default=None, help="extra xcrun metal flag (default -ffast-math)")
    args = parser.parse_args(argv)
    shapes = all_dtypes(DEFAULT_SHAPES) if args.all_dtypes else list(DEFAULT_SHAPES)
    if args.command == "sources":
        args.out.mkdir(parents=True, exist_ok=True)
        for v in record("metal", shapes):
            (args.out / f"{kernel_name(v)}.metal").write_text(UTILS_INCLUDE + metal_source(v))
        print(f"wrote {args.out}")
        return 0
    if args.command == "standin":
        variants = record("metal", shapes)
        ok, log = standin_check(variants)
        print(f"{'ok' if ok else 'FAIL'}: {len(variants)} variants type-check against the stand-in header\n{log}")
        return 0 if ok else 1
    if not xcrun_available():
        print(f"metal_compile check needs macOS with Xcode's command-line tools (xcrun metal); this is {sys.platform}"
              f"{'' if sys.platform != 'darwin' else ' without xcrun'}. Here, `standin` type-checks the sources.",
              file=sys.stderr)  # fmt: skip
        return 2
    if not mx.metal.is_available():
        print("metal_compile check needs MLX's Metal back-end (mx.metal.is_available() is False)", file=sys.stderr)
        return 2
    return check(args.out, shapes, args.metal_flag or ["-ffast-math"])


if __name__ == "__main__":
    raise SystemExit(main())
