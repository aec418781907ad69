"""Build, cache and load trillm's CPU kernels: an MLX C++ extension (`kernels/cpu/`) of custom primitives.

The extension is compiled with CMake against the installed mlx (its headers, CMake config and libmlx) and
nanobind, once per (mlx version, nanobind version, Python, CPU, source hash), into a cache folder
(`$TRILLM_CPU_EXT_CACHE`, default `~/.cache/trillm/cpu-ext`). `dev.sh setup` builds it ahead
(`cpu_ext.main(["build"])`); otherwise the first use builds it. When it cannot be built or
loaded, `load()` returns None, trillm runs the pure-mx references, and one warning says why.
`TRILLM_CPU_EXT=0` turns the extension off.

It is built for one instruction set (`isa()`): the CPU's best of avx512 / avx2 / generic on x86-64 and neon on
ARM, read from its flags, compiled with -march=native; `TRILLM_CPU_ISA=avx2` (or generic, or any the CPU
has) builds and loads that one instead, compiled for the ISA's baseline (-march=x86-64-v3 for avx2), so an
AVX-512 machine can run and measure what an AVX2-only one would. The kernels' vector width and register
tiles follow the ISA (kernels/cpu/simd.h).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from trillm.kernels.backend import kernel_backend
from trillm.kernels.layout import ModelShapes

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
MODULE_NAME = "_trillm_cpu"
DISABLE_ENV = "TRILLM_CPU_EXT"  # "0" / "off": never build or load it
CACHE_ENV = "TRILLM_CPU_EXT_CACHE"
ISA_ENV = "TRILLM_CPU_ISA"  # avx512 / avx2 / neon / generic; unset or "native": the CPU's best
# x86-64 ISAs from the widest down: a CPU runs its own and every one after it.
X86_ISAS = ("avx512", "avx2", "generic")
# Compile flags of an ISA forced below the CPU's own (its own builds with -march=native).
ISA_FLAGS = {"avx512": "-march=x86-64-v4", "avx2": "-march=x86-64-v3", "generic": "-march=x86-64",
             "neon": "-march=armv8-a"}  # fmt: skip
_SOURCE_SUFFIXES = (".cpp", ".h", ".txt")
_OFF = ("0", "off", "false", "no")


class BuildError(RuntimeError):
    """The extension could not be built; the message carries the reason and the build log's tail."""


@dataclass(frozen=True, slots=True)
class ExtStatus:
    available: bool
    reason: str  # why not, or where it was loaded from
    path: Path | None


def cache_root() -> Path:
    if root := os.environ.get(CACHE_ENV):
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trillm" / "cpu-ext"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def native_isa() -> str:
    """The widest instruction set this CPU runs the kernels with."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "neon"
    flags = set(_cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "generic"


def requested_isa() -> str:
    """The ISA to build and load: TRILLM_CPU_ISA if set (and this CPU runs it), else the native one."""
    native = native_isa()
    want = os.environ.get(ISA_ENV, "").strip().lower()
    if want in ("", "native", native):
        return native
    runs = X86_ISAS[X86_ISAS.index(native):] if native in X86_ISAS else (native, "generic")
    if want not in ISA_FLAGS:
        raise BuildError(f"{ISA_ENV}={want!r}: not one of {', '.join(ISA_FLAGS)}")
    if want not in runs:
        raise BuildError(f"{ISA_ENV}={want}: this CPU runs {', '.join(runs)} only")
    return want


def source_files(source_dir: Path = SOURCE_DIR) -> list[Path]:
    return sorted(p for p in source_dir.iterdir() if p.suffix in _SOURCE_SUFFIXES)


def cache_key(source_dir: Path = SOURCE_DIR, isa: str | None = None) -> str:
    """Changes whenever the build would: mlx, nanobind, Python, CPU (-march=native), ISA or any source file."""
    h = hashlib.sha256()
    for part in (_version("mlx"), _version("nanobind"), sys.implementation.cache_tag or "", platform.machine(),
                 _cpu_flags(), str(Path(mx.__file__).resolve().parent), isa or requested_isa()):
        h.update(part.encode() + b"\0")
    for path in source_files(source_dir):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def _built_module(folder: Path) -> Path | None:
    found = sorted(folder.glob(f"{MODULE_NAME}*.so")) + sorted(folder.glob(f"{MODULE_NAME}*.pyd"))
    return found[0] if found else None


def build(source_dir: Path = SOURCE_DIR, cache_dir: Path | None = None, *, force: bool = False,
          isa: str | None = None) -> Path:
    """Compile the extension for `isa` (default: requested_isa()) into its cache folder (unless it is there
    already); returns the module's path."""
    isa = isa or requested_isa()
    root = cache_dir or cache_root()
    target = root / cache_key(source_dir, isa)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key right now
        if not force and (done := _built_module(target)) is not None:
            return done
        missing = [tool for tool in ("cmake", os.environ.get("CXX", "c++")) if shutil.which(tool) is None]
        if missing:
            raise BuildError(f"{' and '.join(missing)} not found (`apt-get install -y g++ cmake`)")
        if importlib.util.find_spec("nanobind") is None:
            raise BuildError("the nanobind package is not installed (`pip install nanobind`)")
        with tempfile.TemporaryDirectory(prefix="trillm-cpu-build-") as tmp:
            out = Path(tmp) / "out"
            configure = ["cmake", "-S", str(source_dir), "-B", str(Path(tmp) / "build"),
                         f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release",
                         f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}",
                         f"-DTRILLM_CPU_NATIVE={'ON' if isa == native_isa() else 'OFF'}",
                         f"-DTRILLM_CPU_ARCH_FLAGS={ISA_FLAGS[isa]}"]  # fmt: skip
            compile_ = ["cmake", "--build", str(Path(tmp) / "build"), f"-j{os.cpu_count() or 1}"]
            for cmd in (configure, compile_):
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode:
                    log = (proc.stdout + proc.stderr).strip().splitlines()
                    raise BuildError(f"`{' '.join(cmd[:2])}` failed:\n" + "\n".join(log[-25:]))
            module = _built_module(out)
            if module is None:
                raise BuildError(f"the build produced no {MODULE_NAME} module")
            staging = root / f"{target.name}.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            shutil.copy2(module, staging / module.name)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)  # atomic: a reader sees a whole module or none
        built = _built_module(target)
        assert built is not None
        return built


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


@cache
def _load() -> tuple[ModuleType | None, ExtStatus]:
    if os.environ.get(DISABLE_ENV, "").lower() in _OFF:
        return None, ExtStatus(False, f"disabled by {DISABLE_ENV}", None)
    try:
        path = build()
        module = _import(path)
    except (BuildError, ImportError, OSError) as exc:
        reason = f"trillm's CPU kernels are unavailable, running the pure-mx references instead: {exc}"
        warnings.warn(reason, RuntimeWarning, stacklevel=3)
        return None, ExtStatus(False, str(exc), None)
    return module, ExtStatus(True, f"loaded from {path}", path)


def isa() -> str:
    """The instruction set the loaded kernels were built for (avx512, avx2, neon, generic), or "ref" when the
    extension is off or unavailable (the pure-mx references run). Every performance figure prints it."""
    module = load() if enabled() else None
    return str(module.SIMD) if module is not None else "ref"


def enabled() -> bool:
    """Whether ops should run the extension now: the default device is the CPU, nothing turned it off, and it
    loads (built on first use)."""
    return kernel_backend() == "cpu" and os.environ.get(DISABLE_ENV, "").lower() not in _OFF and load() is not None


def load() -> ModuleType | None:
    """The extension module, building it on first use; None (after one warning) when it cannot be had."""
    return _load()[0]


def status() -> ExtStatus:
    return _load()[1]


def require() -> ModuleType:
    """The extension module, for an op's "cpu" kernel; RuntimeError with the reason when it cannot be had."""
    if (module := load()) is None:
        raise RuntimeError(f"trillm's CPU extension is unavailable: {status().reason}")
    return module


def supports(shapes: ModelShapes, dtypes: tuple[mx.Dtype, ...]) -> str | None:
    """Why a primitive of the extension cannot run `shapes` (or None). Asking loads, or first builds, it."""
    if shapes.dtype not in dtypes:
        return f"dtype {shapes.dtype} is not one of {', '.join(str(d) for d in dtypes)}"
    if load() is None:
        return f"trillm's CPU extension is unavailable: {status().reason}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["build"]:
        print("usage: cpu_ext.main(['build', '--force'?])", file=sys.stderr)
        return 2
    try:
        path = build(force="--force" in args)
    except BuildError as exc:
        print(f"trillm CPU kernels: not built ({exc}); trillm will run the references", file=sys.stderr)
        return 1
    module = _import(path)
    print(f"trillm CPU kernels: {path} ({module.SIMD}: {module.LANES} floats per vector; "
          f"{module.num_threads()} threads)")
    return 0

