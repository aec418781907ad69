"""llama.cpp's server (llama-cpp-python) as an optional peer of `trillm bench peers`.

What a Linux CPU user would run instead of trillm. Three things live here:
- `install()`: llama-cpp-python[server] built from PyPI's source into its own virtual environment under
  ~/.cache/trillm/peers/ (its server pulls fastapi/uvicorn pins we do not want in trillm's venv). Built with
  -DGGML_AMX=OFF (AMX crashes Q4_1 on these CPUs) and -DGGML_OPENMP=OFF (with OpenMP its decode speed flips
  by 3x from run to run on 2 shared cores).
- `export_f32_gguf()`: the default model's Q4_1 GGUF dequantized to F32 with the `gguf` package (llama.cpp's
  own Python library), so llama.cpp runs the same fp32 weights as trillm and mlx_lm.server.
- `llama_cpp_command()`: its server on loopback, one thread per core, `--interrupt_requests False` (by default
  a new request cancels the one streaming; it serves one request at a time either way).
- `llama_server_command()`: llama.cpp's own C++ `llama-server` instead (`--llama-server PATH` or
  $TRILLM_LLAMA_SERVER), which batches: `--parallel N` slots with continuous batching, the context split
  among them, `-t`/`-tb` threads.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

VERSION = "0.3.36"
CMAKE_ARGS = "-DGGML_AMX=OFF -DGGML_OPENMP=OFF"
CACHE_ROOT = Path(os.environ.get("TRILLM_CACHE", Path.home() / ".cache" / "trillm"))
PYTHON_ENV = "TRILLM_LLAMA_CPP_PYTHON"  # an interpreter with llama_cpp.server importable
SERVER_BIN_ENV = "TRILLM_LLAMA_SERVER"  # llama.cpp's own llama-server binary (used instead of the Python one)
HEALTH_PATH = "/v1/models"  # llama-cpp-python's server has no /health (llama-server's has)


def venv_dir() -> Path:
    return CACHE_ROOT / "peers" / f"llama-cpp-python-{VERSION}"


def has_server(python: str) -> bool:
    """Whether `python -m llama_cpp.server` can start: the package and its server extras import."""
    try:
        done = subprocess.run([python, "-c", "import llama_cpp.server.app"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def find_python(explicit: str | None = None) -> str | None:
    """The interpreter to run llama.cpp's server with: explicit, $TRILLM_LLAMA_CPP_PYTHON, the venv
    `install()` builds, or this one; None when none of them has it."""
    if explicit:
        return explicit if has_server(explicit) else None
    candidates = [os.environ.get(PYTHON_ENV, ""), str(venv_dir() / "bin" / "python"), sys.executable]
    for python in candidates:
        if python and (python == sys.executable or Path(python).exists()) and has_server(python):
            return python
    return None


def install(dest: Path | None = None, jobs: int | None = None) -> str:
    """Build llama-cpp-python[server] from source into a venv at dest; returns its python. Minutes."""
    dest = dest or venv_dir()
    python = dest / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(dest)], check=True)
    env = dict(server_env(), CMAKE_ARGS=CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(jobs or os.cpu_count() or 1))
    subprocess.run([str(python), "-m", "pip", "install", "--no-cache-dir", f"llama-cpp-python[server]=={VERSION}"],
                   check=True, env=env)
    return str(python)


def export_f32_gguf(src: str | os.PathLike[str] | None = None, dest: Path | None = None) -> Path:
    """Write src (default: the bundled SmolLM2 GGUF) with every tensor dequantized to F32; cached by name
    and size. Metadata (tokenizer, chat template, hyper-parameters) is copied as it is; file_type becomes
    ALL_F32."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    from trillm.engine.loader import default_model_path

    src_path = Path(src or default_model_path())
    if dest is None:
        dest = CACHE_ROOT / "gguf" / f"{src_path.stem}-{src_path.stat().st_size}-f32.gguf"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    reader = GGUFReader(src_path)
    arch_field = reader.fields["general.architecture"]
    writer = GGUFWriter(tmp, arch=str(arch_field.contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes the header fields and the architecture itself
        vtype = field.types[0]
        if field.name == "general.file_type":
            writer.add_key_value(field.name, int(LlamaFileType.ALL_F32), vtype)
            continue
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        # numpy shape is GGML's dims reversed; dequantize returns it for quantized blocks as well
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dest)
    return dest


def llama_cpp_command(python: str, gguf: str | os.PathLike[str], port: int, *, n_ctx: int = 4096,
                      threads: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """Its server on loopback: both thread pools one thread per core (its default is half the cores for
    decode), a context that holds the benchmark's longest prompt, and requests queued, not interrupted."""
    n = str(threads or os.cpu_count() or 1)
    return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(n_ctx), "--n_threads", n, "--n_threads_batch", n, "--interrupt_requests", "False",
            *extra]


def llama_server_command(binary: str, gguf: str | os.PathLike[str], port: int, *, parallel: int,
                         n_ctx: int = 4096, threads: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """llama.cpp's own server on loopback: `parallel` slots of n_ctx tokens each (its -c is the total), both
    thread pools one thread per core, no web UI."""
    n = str(threads or os.cpu_count() or 1)
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx * parallel),
            "--parallel", str(parallel), "-t", n, "-tb", n, "--no-webui", *extra]


def server_env() -> dict[str, str]:
    """Its environment (build and server): ours without trillm's BLAS preload (llama.cpp does its own matmuls)."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trillm bench llama-cpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help=f"build llama-cpp-python[server]=={VERSION} into {venv_dir()}")
    i.add_argument("--dest", type=Path, default=None)
    e = sub.add_parser("export", help="write the F32 GGUF llama.cpp serves in bench peers (cached)")
    e.add_argument("gguf", nargs="?", default=None, help="GGUF file (default: the bundled SmolLM2)")
    e.add_argument("--out", type=Path, default=None)
    sub.add_parser("where", help="the interpreter bench peers would run llama.cpp's server with")
    args = p.parse_args(argv)
    if args.cmd == "install":
        print(install(args.dest))
    elif args.cmd == "export":
        print(export_f32_gguf(args.gguf, args.out))
    else:
        python = find_python()
        if python is None:
            print(f"no llama-cpp-python server found; `trillm bench llama-cpp install` builds one in {venv_dir()}",
                  file=sys.stderr)
            return 1
        print(python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
