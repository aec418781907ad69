#!/usr/bin/env bash
# One prepared GPU check for trillm.kernels (Metal on Apple silicon, or MLX CUDA on NVIDIA):
#   bash kernels/tools/gpu_check.sh [results_dir]
# Needs a venv (.venv) where `mlx` has a GPU back-end: `pip install -e '.[cuda13,test]'` on NVIDIA, the
# default install on macOS. Runs the kernel tests (kernel-vs-reference grid included) and the benchmark.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-${OUT:-results}}
mkdir -p "$OUT"
"$PY" - <<'PY'
import trillm.kernels  # BLAS before mlx
import mlx.core as mx
from trillm.kernels._dispatch import kernel_backend
print("mlx", mx.__version__, "device", mx.default_device(), "kernel back-end:", kernel_backend())
if kernel_backend() is None:
    raise SystemExit("no Metal/CUDA back-end in this mlx: nothing GPU to check")
PY
"$PY" -m pytest tests/kernels -q -rs 2>&1 | tee "$OUT/kernel_tests.txt"
"$PY" -m trillm.bench.bench_kernels --results "$OUT" 2>&1 | tee "$OUT/bench_kernels.txt"
