"""The CPU kernels' NEON paths without an ARM machine: every source of the extension compiled for aarch64
against the installed MLX headers (no aarch64 libmlx to link: the front end only), and the kernel bodies
(cpu_bodies.cpp: simd.h and each op's loops, no mlx) cross-compiled per ARM ISA and run under qemu-user
against scalar references: linear, quant_linear's fp32 and integer paths, paged attention on fp32/fp16/int8/int4 pools,
rms_norm, rope, silu_mul and the gated delta rule. The compiles start at collection in the background
(tests/background_builds.py: this file run as a script), so they use a core the suite leaves idle."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import background_builds
from trillm.kernels import cpu_ext

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "cpu_bodies.cpp"
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = next((q for q in ("qemu-aarch64", "qemu-aarch64-static") if shutil.which(q)), None)
# The baseline every aarch64 CPU runs (cpu_ext's flags for a non-native build), and the Armv8.2 cores
# (Graviton 2+, Neoverse, Apple) a native build targets.
ARM_ISAS = [cpu_ext.ISA_FLAGS["neon"], "-march=armv8.2-a+dotprod"]
FLAGS = ["-std=c++20", "-O2", "-fno-math-errno", "-Wall", "-Wno-psabi"]

pytestmark = pytest.mark.skipif(
    shutil.which(CROSS_CXX) is None or QEMU is None,
    reason="needs an aarch64 cross compiler and qemu-user (./dev.sh setup installs g++-aarch64-linux-gnu and "
           "qemu-user)")  # fmt: skip


def _mlx_include() -> Path | None:
    spec = importlib.util.find_spec("mlx")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "include" / "mlx" / "ops.h").is_file():
            return Path(root) / "include"
    return None


def compile_sources(workers: int) -> dict[str, str]:
    """Each source the extension builds (bindings.cpp aside: nanobind and Python's headers are the host's)
    through the cross compiler's front end: {file name: "" if it compiled, else the error's tail}."""
    include = _mlx_include()
    assert include is not None
    sources = [p for p in cpu_ext.source_files() if p.suffix == ".cpp" and p.name != "bindings.cpp"]

    def compile_(src: Path) -> tuple[str, str]:
        # Front end only (templates instantiated, no code generated): the kernel bodies' code generation is
        # the test below's, and the MLX headers' parse is most of the time either way.
        cmd = [CROSS_CXX, *FLAGS, ARM_ISAS[0], f"-I{include}", "-fsyntax-only", str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        return src.name, proc.stderr[-2000:] if proc.returncode else ""

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(compile_, sources))


def bodies_command(march: str, out: Path) -> list[str]:
    return [CROSS_CXX, *FLAGS, march, "-static", f"-I{cpu_ext.SOURCE_DIR}", str(DRIVER), "-o", str(out), "-lpthread"]


def test_extension_sources_compile_for_aarch64() -> None:
    """So a NEON-only compile error in a primitive shows here rather than on the first ARM user's machine."""
    if _mlx_include() is None:
        pytest.skip("the installed mlx ships no C++ headers")
    done = background_builds.wait(background_builds.NEON_SOURCES)  # started at collection
    if done is None:
        results = compile_sources(os.cpu_count() or 1)
    else:
        status, out = done
        assert status == 0, out[-4000:]
        results = json.loads(out.strip().splitlines()[-1])
    failed = {name: err for name, err in results.items() if err}
    assert not failed, failed
    assert {"paged_attention.cpp", "quant_linear.cpp", "linear.cpp"} <= set(results)


@pytest.mark.parametrize("march", ARM_ISAS)
def test_neon_kernel_bodies_match_scalar_references_under_qemu(march: str, tmp_path: Path) -> None:
    assert QEMU is not None
    name = background_builds.neon_bodies(ARM_ISAS.index(march))
    done = background_builds.wait(name)  # started at collection
    out = background_builds.output_path(name)
    if done is None:
        out = tmp_path / "bodies"
        proc = subprocess.run(bodies_command(march, out), capture_output=True, text=True)
        done = proc.returncode, proc.stderr
    assert done[0] == 0, f"{' '.join(bodies_command(march, out))} failed:\n{done[1][-3000:]}"
    run = subprocess.run([QEMU, str(out)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TRILLM_CPU_THREADS="2"))  # fmt: skip
    assert run.returncode == 0 and "all checks passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
    assert run.stdout.startswith("ISA neon: 4 floats per vector, 32 vector registers"), run.stdout.splitlines()[0]
    checked = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("ok ")]
    for op in ("linear", "quant_linear", "paged_attention", "rms_norm", "rope", "silu_mul", "gated_delta"):
        assert op in checked, (op, "not checked")
    assert "int8 KV" in run.stdout and "int4 KV" in run.stdout and "fp16 scales" in run.stdout


if __name__ == "__main__":  # tests/background_builds.py's jobs: `sources`, or `bodies INDEX OUT`
    if sys.argv[1] == "sources":
        print(json.dumps(compile_sources(1)))  # one compile at a time: a background job uses one idle core
    else:
        sys.exit(subprocess.run(bodies_command(ARM_ISAS[int(sys.argv[2])], Path(sys.argv[3]))).returncode)
