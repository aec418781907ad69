#!/usr/bin/env bash
# Dry run, on the CPU machine, of carrying mlx + mlx-cuda + trillm's deps to a bare GPU machine
# (kernels/tools/carry_wheels.py; docs/gpu-check.md says what each stage proves and what it cannot).
#   bash kernels/tools/carry_wheels_dryrun.sh [scratch_dir]      (needs PyPI; leaves .gpu-wheels/ ready to carry)
# 1. the device's set (CPython 3.12): downloaded, split into bundles that fit a call with the working tree,
#    stashed, reassembled against the manifest, and pip-installed offline with pip's tag check for 3.12
#    (no 3.12 interpreter here: --target, nothing imported)
# 2. the same set for CPython 3.11: installed offline into a scratch venv exactly as on the device; libmlx.so's
#    libraries checked with ldd (the CUDA ones cannot resolve here: no driver, no nvidia wheels)
# 3. that venv's twin with mlx-cpu in place of mlx-cuda-13 plus what the device already has: the GPU check
#    (--stub) runs from these packages alone, PYTHONPATH pointing at this checkout
set -euo pipefail
cd "$(dirname "$0")/../.."
HOST_PY=${HOST_PY:-.venv/bin/python}
PY311=${PY311:-python3.11}
S=${1:-/tmp/trillm-carry-dryrun}
rm -rf "$S" && mkdir -p "$S"
CW="$HOST_PY kernels/tools/carry_wheels.py"

echo "== 1. CPython 3.12 (the device's python3)"
$CW download --python 3.12
$CW split
for b in .gpu-wheels/bundle-*; do $CW stash "$b" --to "$S/stash312"; done
$CW dry-install --from "$S/stash312" --target "$S/site312" --as-python 3.12 | cut -c1-160

echo "== 2. CPython 3.11: offline install into a scratch venv, ldd of libmlx.so"
$CW download --python 3.11 --dest "$S/w311" >/dev/null
$CW split --dest "$S/w311"
for b in "$S"/w311/bundle-*; do $CW stash "$b" --to "$S/stash311"; done
"$PY311" -m venv "$S/venv311"
$CW install --python "$S/venv311/bin/python" --from "$S/stash311" --trillm-path "$S/trillm-path" \
  || echo "(expected here: the CUDA libraries above are the device's; see docs/gpu-check.md)"

echo "== 3. the GPU check from the carried packages alone (mlx-cpu standing in for mlx-cuda-13)"
"$HOST_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_35_x86_64 \
  -d "$S/cpu" "mlx-cpu==0.32.4"
"$PY311" -m venv "$S/venv311cpu"
CARRIED=$(ls "$S"/stash311/wheels/*.whl | grep -v /mlx_cuda_13-)
# What the device already has, from the same resolution (its own versions differ; trillm's check needs few).
HAS=$(ls "$S"/w311/all-cp311/*.whl | grep -v -E "/(nvidia_|mlx_cuda_13-)" | grep -v -F -f <(ls "$S"/stash311/wheels | sed 's/-.*//'))
"$S/venv311cpu/bin/python" -m pip install -q --no-index --no-deps --no-compile $CARRIED $HAS "$S"/cpu/*.whl
PYTHONPATH="$S/trillm-path" PYTHON="$S/venv311cpu/bin/python" bash kernels/tools/gpu_check.sh --quick --stub \
  --out "$S/gpu-check" | tail -1
ls -d .gpu-wheels/bundle-* | sed 's/^/ready to carry: /'
