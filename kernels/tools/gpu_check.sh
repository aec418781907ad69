#!/usr/bin/env bash
# The GPU check of trillm.kernels, for a Mac (Metal) or an NVIDIA machine (MLX CUDA): see docs/gpu-check.md.
#
#   bash kernels/tools/gpu_check.sh [--quick | --full] [--out DIR] [--stub] [--steps a,b]   (PYTHON=... picks
#                                                                                               the interpreter)
# --quick (the default): an 8-minute deadline over env -> (macOS: compile) -> selfcheck -> tests ->
# planted-compile -> planted-wrong -> bench, each step's output in <out>/<step>.txt, and one last line
#   VERDICT: PASS|FAIL|SKIP (step=STATUS ...)
# exit 0 (PASS), 1 (FAIL) or 2 (SKIP). The steps live in gpu_check.py (standard library only, run as a file,
# so an interpreter without mlx gets SKIP, not a traceback). A bare CUDA machine first needs the carried
# wheels: kernels/tools/carry_wheels.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1; then PY=$candidate; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "no Python interpreter found (set PYTHON=...)"
  echo "VERDICT: SKIP (env=SKIP)"
  exit 2
fi
exec "$PY" kernels/tools/gpu_check.py --python "$PY" "$@"
