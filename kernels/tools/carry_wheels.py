"""Bring what a bare CUDA machine lacks (mlx, mlx-cuda and trillm's pure-Python deps) as files, offline.

The lent NVIDIA machine has no network and no mlx; each call to it carries at most 64 MiB (the working tree
included) and the machine keeps files only while it stays warm (about 30 s after a call). Procedure and
numbers: docs/gpu-check.md. Standard library only, run as a file: on the GPU machine it runs before mlx
and trillm exist.

Here (the CPU machine, with PyPI):
    python kernels/tools/carry_wheels.py download [--python 3.12] [--dest .gpu-wheels]
        pip download --only-binary=:all: of mlx, mlx-cuda-13 and trillm's runtime + test requirements for the
        target interpreter and platform; keeps what the device does not have (DEVICE_HAS: its image's package
        list) and never the nvidia-* CUDA libraries (the device's torch brings them)
    python kernels/tools/carry_wheels.py split [--dest .gpu-wheels] [--max-mib 60]
        splits every wheel larger than --max-mib into parts, packs wheels and parts into bundle-1, bundle-2,
        ... of at most --max-mib each, and writes manifest.json (sha256 of every wheel and part) into each
There (the GPU machine), one `run` per bundle, back to back (the machine must stay warm between them):
    python3 kernels/tools/carry_wheels.py stash .gpu-wheels/bundle-N          # copies into /tmp/trillm-wheels
    python3 kernels/tools/carry_wheels.py install [--python python3]          # after the last bundle:
        reassembles and checks every wheel against the manifest, then
        `pip install --no-index --no-deps --no-compile` into that interpreter's environment (where the
        nvidia/*/lib folders are that libmlx.so's RPATH names), checks libmlx.so's libraries with ldd, and
        writes /tmp/trillm-path/trillm -> this checkout (PYTHONPATH=/tmp/trillm-path: no build of trillm)
    python3 kernels/tools/carry_wheels.py verify [--python python3]           # ldd + import, again

Wheel files never go into git: .gpu-wheels/ is in .gitignore.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ROOT / ".gpu-wheels"
STASH = Path("/tmp/trillm-wheels")
TRILLM_PATH = Path("/tmp/trillm-path")
MIB = 2**20
TRANSFER_MIB = 64  # what one call carries, the working tree included
DEFAULT_MAX_MIB = 60  # per bundle: leaves 4 MiB for the working tree (about 2 MiB tracked)
MLX_VERSION = "0.32.4"
MLX_PINS = (f"mlx=={MLX_VERSION}", f"mlx-cuda-13=={MLX_VERSION}")
# pip matches manylinux tags exactly: the ones the wanted wheels use (mlx-cuda-13: 2_35; others older).
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")  # fmt: skip
SUPPORTED_PYTHONS = ("3.11", "3.12")
# The nvidia-h200 image's Python packages (/work/.library/device/KINDS.md, read 2026-11-17; its python3 is
# 3.12.3 in /opt/torch/.venv with torch 2.11.0+cu130). Not carried: the device has them.
DEVICE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# What trillm's pyproject asks at run time (plus the test runner's trio plugin), without the mlx pins.
RUNTIME_REQUIREMENTS = ("mlx-lm>=0.32.2,<0.33", "trio==0.35.0", "anyio>=4", "quart==0.22.0", "quart-trio==0.12.0",
                        "hypercorn[trio]==0.18.0", "httpx==0.28.1", "trio-websocket==0.12.2", "tokenizers>=0.21",
                        "transformers>=4.50", "jinja2>=3.1", "pydantic>=2.7", "numpy>=1.26", "tqdm>=4.66",
                        "llguidance>=1.9,<2", "gguf>=0.17,<1", "pytest>=8", "pytest-trio==0.8.0")  # fmt: skip
# libmlx.so's NEEDED libraries that its RPATH or the system must provide (checked by `verify`).
CUDA_LIBS = ("libcuda.so.1", "libcublasLt.so.13", "libcufft.so.12", "libcusolver.so.12", "libnvrtc.so.13",
             "libcudnn.so.9", "libnccl.so.2")  # fmt: skip


def normalize(name: str) -> str:
    """PEP 503: the project name a wheel's file name starts with, compared case- and separator-blind."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(filename: str) -> str:
    return normalize(filename.split("-", 1)[0])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def carried(filenames: list[str], device_has: frozenset[str] = DEVICE_HAS) -> list[str]:
    """The wheels to carry: mlx and mlx-cuda always; others unless the device has them or they are nvidia-*."""
    keep = []
    for f in filenames:
        project = wheel_project(f)
        if project in ("mlx", "mlx-cuda-13"):
            keep.append(f)
        elif not project.startswith("nvidia-") and project not in device_has:
            keep.append(f)
    return sorted(keep)


def pip_download_cmd(python: str, dest: Path, requirements: list[str], *, deps: bool) -> list[str]:
    version = python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "--abi", f"cp{version}", "--abi", "abi3", "--abi", "none",
           "-d", str(dest), "-q"]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += ["--platform", "any"]
    if not deps:
        cmd.append("--no-deps")
    return cmd + requirements


def download(dest: Path, python: str) -> list[Path]:
    """Resolve and download for `python` on manylinux x86_64 into dest/all, keep `carried` ones in dest/wheels."""
    if python not in SUPPORTED_PYTHONS:
        raise SystemExit(f"--python must be one of {SUPPORTED_PYTHONS} (the device's python3 is 3.12)")
    every = dest / f"all-cp{python.replace('.', '')}"
    every.mkdir(parents=True, exist_ok=True)
    # The mlx pins alone with --no-deps: mlx-cuda-13's nvidia-* requirements are GBs the device has.
    subprocess.run(pip_download_cmd(python, every, list(MLX_PINS), deps=False), check=True)
    # mlx pinned here too: mlx-lm's bare `mlx` requirement would otherwise fetch the newest.
    subprocess.run(pip_download_cmd(python, every, [MLX_PINS[0], *RUNTIME_REQUIREMENTS], deps=True), check=True)
    names = [p.name for p in every.glob("*.whl")]
    projects = [wheel_project(n) for n in names]
    if dupes := sorted({p for p in projects if projects.count(p) > 1}):
        raise SystemExit(f"two versions of {dupes} in {every}: empty it and download again (pip installs one)")
    wheels = dest / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    out = []
    for name in carried(names):
        shutil.copy2(every / name, wheels / name)
        out.append(wheels / name)
    return out


@dataclass(frozen=True, slots=True)
class Piece:
    """A file that travels: a whole wheel, or part `index` of a split one."""

    path: Path
    wheel: str
    index: int | None  # None: the whole wheel


def split(dest: Path, max_mib: float) -> list[Path]:
    """Split wheels over max_mib into parts, pack everything into bundles of at most max_mib, write manifests."""
    wheels = sorted((dest / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {dest / 'wheels'}: run `download` first")
    limit = int(max_mib * MIB) - 64 * 1024  # the manifest travels in every bundle
    parts_dir = dest / "parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir()
    manifest: dict[str, dict[str, object]] = {}
    pieces: list[Piece] = []
    for w in wheels:
        parts: list[dict[str, str]] = []
        if w.stat().st_size <= limit:
            pieces.append(Piece(w, w.name, None))
        else:
            with w.open("rb") as f:
                for i, block in enumerate(iter(lambda: f.read(limit), b"")):
                    part = parts_dir / f"{w.name}.part{i:02d}"
                    part.write_bytes(block)
                    parts.append({"name": part.name, "sha256": hashlib.sha256(block).hexdigest()})
                    pieces.append(Piece(part, w.name, i))
        manifest[w.name] = {"sha256": sha256(w), "size": w.stat().st_size, "parts": parts}
    # First fit, largest first: bundles of at most `limit` bytes.
    bundles: list[list[Piece]] = []
    sizes: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p.path.stat().st_size):
        n = piece.path.stat().st_size
        for i, used in enumerate(sizes):
            if used + n <= limit:
                bundles[i].append(piece)
                sizes[i] += n
                break
        else:
            bundles.append([piece])
            sizes.append(n)
    for old in dest.glob("bundle-*"):
        shutil.rmtree(old)
    out = []
    text = json.dumps({"bundles": len(bundles), "wheels": manifest}, indent=1)
    for i, bundle in enumerate(bundles, 1):
        folder = dest / f"bundle-{i}"
        folder.mkdir()
        for piece in bundle:
            shutil.copy2(piece.path, folder / piece.path.name)
        (folder / "manifest.json").write_text(text)
        out.append(folder)
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def tree_bytes(root: Path = ROOT) -> int | None:
    """What a call sends besides the carried paths: tracked and untracked-not-ignored files (None: no git)."""
    try:
        proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                              capture_output=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    files = [root / f for f in proc.stdout.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file())


def stash(bundle: Path, stash_dir: Path = STASH) -> list[Path]:
    """Copy one carried bundle out of the checkout (a later call's copy of the tree may drop it)."""
    stash_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for f in sorted(bundle.iterdir()):
        shutil.copy2(f, stash_dir / f.name)
        out.append(stash_dir / f.name)
    return out


def reassemble(stash_dir: Path = STASH) -> list[Path]:
    """Every wheel of the manifest, whole and checked, in stash_dir/wheels; SystemExit naming what is missing."""
    manifest = json.loads((stash_dir / "manifest.json").read_text())["wheels"]
    wheels = stash_dir / "wheels"
    wheels.mkdir(exist_ok=True)
    missing = []
    out = []
    for name, entry in sorted(manifest.items()):
        target = wheels / name
        if entry["parts"]:
            paths = [stash_dir / p["name"] for p in entry["parts"]]
            missing += [p.name for p in paths if not p.is_file()]
            if any(not p.is_file() for p in paths):
                continue
            bad = [p.name for p, e in zip(paths, entry["parts"]) if sha256(p) != e["sha256"]]
            if bad:
                raise SystemExit(f"parts damaged in transfer: {bad}")
            with target.open("wb") as f:
                for p in paths:
                    f.write(p.read_bytes())
        elif (stash_dir / name).is_file():
            shutil.copy2(stash_dir / name, target)
        else:
            missing.append(name)
            continue
        if sha256(target) != entry["sha256"]:
            raise SystemExit(f"{name}: sha256 differs from the manifest after reassembly")
        with zipfile.ZipFile(target) as zf:
            if zf.testzip() is not None:
                raise SystemExit(f"{name}: a member fails its CRC")
        out.append(target)
    if missing:
        raise SystemExit(f"not carried yet (or the machine went cold between calls): {missing}")
    return out


def install_cmd(python: str, wheels: list[Path], target: Path | None = None, as_python: str | None = None) -> list[str]:
    """The offline install. `as_python` (with `target`): pip's tag check for another interpreter version on
    the device's platform, which is how the cp312 set is dry-run where no 3.12 exists."""
    cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "-q"]  # fmt: skip
    if target is not None:
        cmd += ["--target", str(target)]
    if as_python is not None:
        cmd += ["--only-binary=:all:", "--python-version", as_python, "--implementation", "cp",
                "--abi", f"cp{as_python.replace('.', '')}", "--abi", "abi3", "--abi", "none"]  # fmt: skip
        for p in PLATFORMS:
            cmd += ["--platform", p]
    return cmd + [str(w) for w in wheels]


def link_trillm(dest: Path = TRILLM_PATH, root: Path = ROOT) -> Path:
    """dest/trillm/{engine,kernels,web,bench} -> this checkout: `PYTHONPATH=dest` imports trillm as it is here."""
    pkg = dest / "trillm"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in ("engine", "kernels", "web", "bench"):
        link = pkg / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(root / name, target_is_directory=True)
    return dest


def libmlx_path(python: str) -> Path | None:
    code = "import importlib.util as u, pathlib as p; s = u.find_spec('mlx'); print(p.Path(list(s.submodule_search_locations)[0]) / 'lib' / 'libmlx.so' if s else '')"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    text = proc.stdout.strip()
    return Path(text) if text else None


def verify(python: str) -> int:
    """ldd of libmlx.so (which CUDA libraries resolve) and `import mlx.core` on `python`: 0 when both work."""
    lib = libmlx_path(python)
    if lib is None or not lib.is_file():
        print(f"no mlx/lib/libmlx.so for {python}: mlx (or mlx-cuda-13) is not installed there")
        return 1
    print(f"libmlx.so: {lib} ({lib.stat().st_size / MIB:.0f} MiB)")
    ldd = subprocess.run(["ldd", str(lib)], capture_output=True, text=True)
    not_found = sorted({line.split()[0] for line in ldd.stdout.splitlines() if "not found" in line})
    for name in CUDA_LIBS:
        line = next((ln.strip() for ln in ldd.stdout.splitlines() if ln.strip().startswith(name)), f"{name} => ?")
        print(f"  {line}")
    print(f"ldd: {'every library resolves' if not not_found else 'NOT FOUND: ' + ', '.join(not_found)}")
    if not_found:  # RPATH is site-packages/nvidia/<lib>/lib and nvidia/cu13/lib: other layouts need a path
        dirs = [str(p) for p in sorted(lib.parents[2].glob("nvidia/*/lib")) + [Path("/usr/local/nvidia/lib64")] if p.is_dir()]
        print(f"  if these exist elsewhere: export LD_LIBRARY_PATH={':'.join(dirs) or '<the nvidia lib folders>'}")
    code = "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available(), mx.default_device())"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    print(proc.stdout.strip() or proc.stderr.strip().splitlines()[-1])
    return 0 if not not_found and proc.returncode == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="carry_wheels", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download")
    d.add_argument("--python", default="3.12", choices=SUPPORTED_PYTHONS)
    d.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    s = sub.add_parser("split")
    s.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    s.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB)
    st = sub.add_parser("stash")
    st.add_argument("bundle", type=Path)
    st.add_argument("--to", type=Path, default=STASH)
    i = sub.add_parser("install")
    i.add_argument("--python", default="python3")
    i.add_argument("--from", dest="stash", type=Path, default=STASH)
    i.add_argument("--target", type=Path, default=None, help="pip --target (then libmlx's RPATH misses nvidia/)")
    i.add_argument("--trillm-path", type=Path, default=TRILLM_PATH)
    t = sub.add_parser("dry-install", help="here: reassemble from a stash, pip install --target as another Python")
    t.add_argument("--from", dest="stash", type=Path, default=STASH)
    t.add_argument("--target", type=Path, required=True)
    t.add_argument("--as-python", default="3.12", choices=SUPPORTED_PYTHONS)
    v = sub.add_parser("verify")
    v.add_argument("--python", default="python3")
    args = parser.parse_args(argv)
    if args.command == "download":
        for w in download(args.dest, args.python):
            print(f"{w.stat().st_size / MIB:8.1f} MiB  {w.name}")
        return 0
    if args.command == "split":
        tree = tree_bytes()
        for folder in split(args.dest, args.max_mib):
            size = folder_bytes(folder)
            total = size + (tree or 0)
            print(f"{folder.name}: {size / MIB:.1f} MiB ({len(list(folder.iterdir()))} files); with the working tree "
                  f"{total / MIB:.1f} MiB of {TRANSFER_MIB}" + ("" if total <= TRANSFER_MIB * MIB else "  TOO LARGE"))  # fmt: skip
            if total > TRANSFER_MIB * MIB:
                return 1
        return 0
    if args.command == "stash":
        files = stash(args.bundle, args.to)
        print(f"stashed {len(files)} files ({sum(f.stat().st_size for f in files) / MIB:.1f} MiB) in {args.to}")
        return 0
    if args.command == "install":
        wheels = reassemble(args.stash)
        print(f"reassembled and checked {len(wheels)} wheels ({sum(w.stat().st_size for w in wheels) / MIB:.1f} MiB)")
        subprocess.run(install_cmd(args.python, wheels, args.target), check=True)
        print(f"installed into {args.target or args.python + ' environment'}")
        print(f"PYTHONPATH={link_trillm(args.trillm_path)}")
        return verify(args.python) if args.target is None else 0
    if args.command == "dry-install":
        wheels = reassemble(args.stash)
        subprocess.run(install_cmd(sys.executable, wheels, args.target, args.as_python), check=True)
        names = sorted(p.name for p in args.target.iterdir())
        print(f"pip accepted {len(wheels)} wheels for CPython {args.as_python} on manylinux x86_64; "
              f"{folder_bytes(args.target) / MIB:.0f} MiB in {args.target}: {' '.join(names)}")
        return 0
    return verify(args.python)


if __name__ == "__main__":
    raise SystemExit(main())
