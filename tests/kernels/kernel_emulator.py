"""Run the shared kernel bodies on the CPU: g++ plus one std::thread per GPU thread.

A host prelude maps the names the bodies use (see trillm.kernels.backend) onto C++20: thread indices are
thread_locals, simd_sum/simd_max exchange values through a per-simdgroup std::barrier, BARRIER() is a
threadgroup std::barrier, and SHARED is `static` (threadgroups run one at a time). The kernel text,
template constants and launch wrapper are exactly what Metal/CUDA get, so this checks the algorithm
(indexing, online softmax, partitions, reduction) numerically; not memory ordering, speed or dtypes
other than float32/float16 (and int8 / uint8 pools).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

import trillm.kernels  # noqa: F401  (BLAS before mlx)
from trillm.kernels.tools.variants import template_decls
import mlx.core as mx

from trillm.kernels import backend as kb

BACKEND = "emulate"
CACHE_DIR = Path(tempfile.gettempdir()) / "trillm-kernel-emulator"
_C_TYPES = {mx.float32: "float", mx.float16: "_Float16", mx.int32: "int32_t", mx.int8: "int8_t", mx.uint8: "uint8_t"}
_NP_TYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.int32: np.int32, mx.int8: np.int8,
             mx.uint8: np.uint8}

HOST_PRELUDE = kb.COMMON_PRELUDE + """
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>
struct emu_uint3 { unsigned x, y, z; };
struct EmuWarp { std::barrier<> bar{32}; float vals[32]; };
static thread_local emu_uint3 thread_position_in_threadgroup, threadgroup_position_in_grid, thread_position_in_grid;
static thread_local unsigned thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
static thread_local EmuWarp* emu_warp;
static thread_local std::barrier<>* emu_group;
#define SHARED static
#define BARRIER() emu_group->arrive_and_wait()
#define EXPF(x) std::exp(x)
#define RINTF(x) std::nearbyint(x)
#define DIV_RN(a, b) ((a) / (b))
#define UNROLL _Pragma("GCC unroll 16")
static float simd_sum(float x) {
  emu_warp->vals[thread_index_in_simdgroup] = x;
  emu_warp->bar.arrive_and_wait();
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += emu_warp->vals[i];
  emu_warp->bar.arrive_and_wait();
  return s;
}
static float simd_max(float x) {
  emu_warp->vals[thread_index_in_simdgroup] = x;
  emu_warp->bar.arrive_and_wait();
  float s = emu_warp->vals[0];
  for (int i = 1; i < 32; ++i) s = MAXF(s, emu_warp->vals[i]);
  emu_warp->bar.arrive_and_wait();
  return s;
}
"""

_LAUNCH = """
extern "C" void emu_launch(void** in, void** out, int gx, int gy, int gz, int tx) {
  for (unsigned z = 0; z < (unsigned)gz; ++z)
  for (unsigned y = 0; y < (unsigned)gy; ++y)
  for (unsigned bx = 0; bx < (unsigned)((gx + tx - 1) / tx); ++bx) {
    std::barrier<> group(tx);
    std::vector<EmuWarp> warps((tx + 31) / 32);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < (unsigned)tx; ++t) {
      auto run = [&, t] {
        thread_position_in_threadgroup = {t, 0, 0};
        threadgroup_position_in_grid = {bx, y, z};
        thread_position_in_grid = {bx * tx + t, y, z};
        thread_index_in_simdgroup = t % 32;
        simdgroup_index_in_threadgroup = t / 32;
        emu_warp = &warps[t / 32];
        emu_group = &group;
        emu_kernel(@ARGS@);
      };
      // Bodies without barriers or simd reductions need no concurrency: run their threads in turn.
      if (@SEQUENTIAL@) run(); else threads.emplace_back(run);
    }
    for (auto& th : threads) th.join();
  }
}
"""


def _source(name: str, input_names: list[str], output_names: list[str], body: str, header: str,
            in_dtypes: list[mx.Dtype], out_dtypes: list[mx.Dtype], template: list[tuple[str, Any]]) -> str:
    params = [f"const {_C_TYPES[dt]}* {n}" for n, dt in zip(input_names, in_dtypes)]
    params += [f"{_C_TYPES[dt]}* {n}" for n, dt in zip(output_names, out_dtypes)]
    consts = template_decls(template, _C_TYPES)
    args = [f"({_C_TYPES[dt]}*)in[{i}]" for i, dt in enumerate(in_dtypes)]
    args += [f"({_C_TYPES[dt]}*)out[{i}]" for i, dt in enumerate(out_dtypes)]
    kernel = "static void emu_kernel(" + ", ".join(params) + ") {\n" + "\n".join(consts) + "\n" + body + "\n}\n"
    sequential = "BARRIER()" not in body and "simd_" not in body
    launch = _LAUNCH.replace("@ARGS@", ", ".join(args)).replace("@SEQUENTIAL@", "true" if sequential else "false")
    return header + "\n" + kernel + launch


@cache
def _compile(source: str) -> ctypes.CDLL:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    lib = CACHE_DIR / f"k{hashlib.sha256(source.encode()).hexdigest()[:16]}.so"
    if not lib.exists():
        # Other test processes share this cache: build under private names, then publish atomically.
        tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.{threading.get_ident()}")
        src = tmp.with_suffix(".cpp")
        src.write_text(source)
        cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", str(src), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        src.unlink(missing_ok=True)
        if proc.returncode:
            raise RuntimeError(f"emulator compile failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


def emulator_factory(*, name: str, input_names: list[str], output_names: list[str], source: str, header: str) -> Any:
    """A stand-in for mx.fast.metal_kernel/cuda_kernel whose calls run on the CPU."""

    def call(*, inputs: list[mx.array], template: list[tuple[str, Any]], grid: tuple[int, int, int],
             threadgroup: tuple[int, int, int], output_shapes: list[Any], output_dtypes: list[mx.Dtype],
             **_: Any) -> list[mx.array]:
        in_np = [np.ascontiguousarray(np.array(x), dtype=_NP_TYPES[x.dtype]) for x in inputs]
        # Unwritten outputs show: NaN, or -128 for int8 (symmetric quantization never writes it).
        out_np = [np.full(tuple(s), np.nan if dt != mx.int8 else -128, dtype=_NP_TYPES[dt])
                  for s, dt in zip(output_shapes, output_dtypes)]  # fmt: skip
        lib = _compile(_source(name, input_names, output_names, source, header,
                               [x.dtype for x in inputs], list(output_dtypes), template))  # fmt: skip
        ins = (ctypes.c_void_p * len(in_np))(*[x.ctypes.data for x in in_np])
        outs = (ctypes.c_void_p * len(out_np))(*[x.ctypes.data for x in out_np])
        assert threadgroup[1] == threadgroup[2] == 1
        lib.emu_launch(ins, outs, grid[0], grid[1], grid[2], threadgroup[0])
        return [mx.array(x) for x in out_np]

    return call


def install() -> None:
    """Register the emulator as back-end "emulate" for trillm.kernels.backend.build."""
    kb.FACTORIES[BACKEND] = emulator_factory
    kb.PRELUDES[BACKEND] = HOST_PRELUDE
