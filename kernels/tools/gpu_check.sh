#!/usr/bin/env bash
# One prepared GPU check for trillm.kernels, for a Mac (Metal) or an NVIDIA machine (MLX CUDA):
#
#   bash kernels/tools/gpu_check.sh [results_dir]        (PYTHON=... to pick the interpreter)
#
# Written and syntax-checked where no GPU exists: it has never run on one. So every step runs even when an
# earlier one fails, each step's output goes to <results_dir>/<step>.txt, and the summary at the end (also
# <results_dir>/summary.txt) says which steps passed; the exit status is non-zero when any did not.
#   env        mlx version, device, kernel back-end (stops here, status 2, when there is no GPU back-end)
#   selfcheck  python -m trillm.kernels.selfcheck: every preset x dtype, each kernel against its reference
#              (the engine's start-up check), timed against it; JSON in selfcheck.json
#   compile    macOS: tools/metal_compile check (MLX's generated source of every variant, xcrun metal -c);
#              NVIDIA: tools/cuda_compile check (nvcc on MLX's wrapper), when nvcc and the headers exist
#   tests      pytest tests/kernels (the kernel-vs-reference grid runs only here, on a GPU)
#   bench      trillm bench kernels (kernel vs reference vs gather + SDPA, GB/s against the peak)
# Needs a venv where `mlx` has a GPU back-end: the default install on macOS, `pip install -e '.[cuda13,test]'`
# on NVIDIA. Decisions of the self-check are cached in <results_dir>/kernel-cache, not in ~/.cache.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-${OUT:-results/gpu-check}}
mkdir -p "$OUT"
export TRILLM_KERNEL_CACHE="$OUT/kernel-cache"
unset TRILLM_KERNELS
SUMMARY=()
FAILED=0

# step NAME SECONDS CMD...: run CMD with its output in $OUT/NAME.txt, under a time limit where `timeout` exists
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  local start=$SECONDS rc
  if command -v timeout >/dev/null 2>&1; then
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  else
    "$@" 2>&1 | tee "$OUT/$name.txt"
  fi
  rc=${PIPESTATUS[0]}
  SUMMARY+=("$(printf '%-10s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - start)))")
  [ "$rc" -eq 0 ] || FAILED=1
  return 0
}

step env 120 "$PY" - <<'PY'
import sys

import trillm.kernels  # BLAS before mlx
import mlx.core as mx
from trillm.kernels.backend import kernel_backend
from trillm.kernels.selfcheck import device_description

print("python", sys.version.split()[0], "mlx", getattr(mx, "__version__", "?"), "device", device_description())
print("kernel back-end:", kernel_backend(), "metal", mx.metal.is_available(),
      "cuda", getattr(mx, "cuda", None) is not None and mx.cuda.is_available())
if kernel_backend() not in ("metal", "cuda"):
    raise SystemExit("no Metal/CUDA back-end in this mlx: nothing GPU to check")
PY
if [ "$FAILED" -ne 0 ] && [ -z "${GPU_CHECK_ANYWAY:-}" ]; then
  echo "no GPU back-end: stopping after env (see $OUT/env.txt; GPU_CHECK_ANYWAY=1 runs the rest on CPU)"
  exit 2
fi

step selfcheck 1200 "$PY" -m trillm.kernels.selfcheck --json "$OUT/selfcheck.json"
if [ "$(uname)" = Darwin ]; then
  step compile 1200 "$PY" -m trillm.kernels.tools.metal_compile check --all-dtypes --out "$OUT/metal-sources"
elif command -v nvcc >/dev/null 2>&1 || [ -n "${NVCC:-}" ]; then
  "$PY" -m trillm.kernels.tools.cuda_compile fetch >/dev/null 2>&1 || true
  step compile 1200 "$PY" -m trillm.kernels.tools.cuda_compile check
fi
step tests 1800 "$PY" -m pytest tests/kernels -q -rs
step bench 1800 "$PY" -m trillm.bench.bench_kernels --results "$OUT"

printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
exit "$FAILED"
