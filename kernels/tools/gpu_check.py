"""The GPU check of trillm.kernels: one prepared run that proves the kernels on a GPU, or sets them aside.

    bash kernels/tools/gpu_check.sh [--quick | --full] [--out DIR] [--stub] [--steps a,b]   (see docs/gpu-check.md)

Standard library only, and run as a file (not `-m`): it must report "SKIP: no mlx" on an interpreter that
lacks mlx or trillm instead of dying at an import. Every step is a subprocess in its own session (killed
with its children at its limit, so nothing is left holding the GPU), its output in <out>/<step>.txt.

--quick (the default) fits 15 minutes of a lent GPU: a global deadline of 8 minutes, steps
  env             python, mlx, device, kernel back-end (SKIP when there is no Metal/CUDA back-end or no mlx)
  compile         macOS only: metal_compile check (xcrun on MLX's own generated source of every variant);
                  CUDA's compile check (nvcc) is CPU-only work and runs on the CPU machine, not here
  selfcheck       every preset x dtype: each kernel variant against its reference on this device
  tests           tests/kernels/test_kernels_vs_ref.py, float16 cases (never when this check runs inside pytest)
  planted-compile a planted compile error must raise a catchable Python error and fall back
  planted-wrong   a planted wrong result must fail the check and fall back
  bench           trillm bench kernels --contexts 512,4096 --batches 1,64
and one last line `VERDICT: PASS|FAIL|SKIP (step=STATUS ...)`: FAIL when a step failed, PASS when every
step passed, else SKIP (a missing prerequisite, the deadline, or a step that cannot run here). Exit 0/1/2.
A step that starts with too little time left is SKIP ("deadline"); one that outruns its limit is FAIL.
--full: a 60-minute deadline, all of tests/kernels and bench's own defaults.
--stub: a dry run on a machine without a GPU: the CPU back-end stands in, the planted checks run through
the g++ kernel emulator (tests/kernels/kernel_emulator.py), the self-check and bench run tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
QUICK_DEADLINE_S = 480
FULL_DEADLINE_S = 3600
MIN_STEP_S = 15  # a step with less left than this is not started
SKIP_CODE = 77  # a step's "prerequisite missing" exit status (automake's convention)
NESTED_ENV = "GPU_CHECK_NESTED"  # set in every step's environment: a check inside a check runs no tests

# The env step. Exit 77 when mlx, trillm or a GPU back-end is missing (argv[1] == "stub": CPU will do).
ENV_SNIPPET = r"""
import sys
print("python", sys.version.split()[0], sys.executable)
try:
    import trillm.kernels  # BLAS before mlx
    import mlx.core as mx
except ImportError as exc:
    print(f"cannot import mlx / trillm: {exc}")
    raise SystemExit(77)
from trillm.kernels.backend import cuda_available, kernel_backend
from trillm.kernels.selfcheck import device_description
print("mlx", getattr(mx, "__version__", "?"), "from", mx.__file__)
print("device", device_description())
info = mx.device_info() if hasattr(mx, "device_info") else {}
print("device info", {k: v for k, v in info.items() if isinstance(v, (int, float, str))})
backend = kernel_backend()
print("kernel back-end:", backend, "metal", mx.metal.is_available(), "cuda", cuda_available())
if backend not in ("metal", "cuda") and sys.argv[1:] != ["stub"]:
    print("no Metal/CUDA back-end in this mlx: nothing GPU to check")
    raise SystemExit(77)
print("2 + 2 on the device:", (mx.array(2) + mx.array(2)).item())
"""


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    cmd: tuple[str, ...]
    cap_s: float  # the most seconds it may run (the deadline may leave less)
    skip_codes: tuple[int, ...] = (SKIP_CODE,)
    why_not: str | None = None  # set: not run here, SKIP with this reason
    is_pytest: bool = False  # rc 0 with no test passed (all skipped) is SKIP, and rc 5 (none collected)


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    seconds: float
    detail: str


def _pump(stream: IO[str], log: IO[str]) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the step's whole session, then SIGKILL what is left after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, out_dir: Path, env: dict[str, str], deadline: float) -> Result:
    """Run one step under min(its cap, the time left before `deadline` (time.monotonic()))."""
    if step.why_not is not None:
        print(f"== {step.name}: SKIP ({step.why_not})", flush=True)
        return Result(step.name, "SKIP", 0.0, step.why_not)
    left = deadline - time.monotonic()
    if left < MIN_STEP_S:
        why = f"deadline: {max(0, int(left))} s left"
        print(f"== {step.name}: SKIP ({why})", flush=True)
        return Result(step.name, "SKIP", 0.0, why)
    limit = min(step.cap_s, left)
    print(f"== {step.name} (limit {limit:.0f} s): {' '.join(step.cmd)}", flush=True)
    t0 = time.monotonic()
    log_path = out_dir / f"{step.name}.txt"
    with log_path.open("w") as log:
        try:
            proc = subprocess.Popen(step.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", env=env, cwd=ROOT, start_new_session=True)  # fmt: skip
        except OSError as exc:
            return Result(step.name, "SKIP", 0.0, f"cannot start {step.cmd[0]}: {exc}")
        pump = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
        pump.start()
        timed_out = False
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode if proc.returncode is not None else -9
        pump.join(5.0)
    seconds = round(time.monotonic() - t0, 1)
    if timed_out:
        return Result(step.name, "FAIL", seconds, f"timed out after {limit:.0f} s (killed with its children)")
    if rc in step.skip_codes:
        return Result(step.name, "SKIP", seconds, f"exit {rc}: a prerequisite is missing (see {log_path.name})")
    if step.is_pytest:
        text = log_path.read_text(errors="replace")
        if rc == 5 or (rc == 0 and " passed" not in text):
            return Result(step.name, "SKIP", seconds, "pytest ran no test (all skipped or none collected)")
    if rc != 0:
        return Result(step.name, "FAIL", seconds, f"exit {rc} (see {log_path.name})")
    return Result(step.name, "PASS", seconds, "")


def verdict(results: list[Result]) -> str:
    """FAIL if any step failed, PASS if all passed, else SKIP."""
    statuses = {r.status for r in results}
    overall = "FAIL" if "FAIL" in statuses else "PASS" if statuses == {"PASS"} else "SKIP"
    return f"VERDICT: {overall} (" + " ".join(f"{r.name}={r.status}" for r in results) + ")"


def inside_pytest(environ: dict[str, str]) -> bool:
    return bool(environ.get("PYTEST_CURRENT_TEST") or environ.get(NESTED_ENV))


def plan(py: str, out: Path, *, full: bool, stub: bool, in_pytest: bool, system: str) -> list[Step]:
    """The steps, in order (env first: the others run only when it passed)."""
    m = (py, "-m")
    selfcheck = [*m, "trillm.kernels.selfcheck", "--json", str(out / "selfcheck.json")]
    bench = [*m, "trillm.web.cli", "bench", "kernels", "--results", str(out)]
    if stub:
        selfcheck += ["--preset", "smollm2-135m", "--dtype", "float32", "--max-batch", "2", "--chunk", "8"]
        bench += ["--contexts", "512", "--batches", "1", "--iters", "1", "--peak-gbs", "1", "--no-decode-step"]
    elif not full:
        bench += ["--contexts", "512,4096", "--batches", "1,64"]
    tests_path = "tests/kernels" if full else "tests/kernels/test_kernels_vs_ref.py"
    # --noconftest: tests/conftest.py loads the engine (mlx-lm, transformers), which this grid never needs.
    tests: tuple[str, ...] = (*m, "pytest", "--noconftest", "-q", "-rs", "--durations=5", "-p", "no:cacheprovider", tests_path,
             "--ignore=tests/kernels/test_gpu_check.py")  # fmt: skip
    if not full:  # float16 only (130 of 390 cases: each case is a new variant to compile); --full: all dtypes
        tests += ("-k", "f16 and not bf16")
    why_no_tests = None
    if in_pytest:
        why_no_tests = "inside pytest (or another GPU check): the suite never runs itself"
    elif stub:
        why_no_tests = "stub: the kernel-vs-reference grid needs the real back-end"
    elif not (ROOT / "tests" / "kernels" / "test_kernels_vs_ref.py").is_file():
        why_no_tests = f"no tests/kernels/test_kernels_vs_ref.py under {ROOT}"
    planted = [*m, "trillm.kernels.tools.planted"]
    steps = [Step("env", (py, "-c", ENV_SNIPPET, *(["stub"] if stub else [])), 45)]
    if system == "Darwin":
        metal = (*m, "trillm.kernels.tools.metal_compile", "check", "--all-dtypes", "--out", str(out / "metal-sources"))
        steps.append(Step("compile", metal, 600 if full else 120, skip_codes=(2, SKIP_CODE)))
    steps += [
        Step("selfcheck", tuple(selfcheck), 1200 if full else 180, skip_codes=(2, SKIP_CODE)),
        Step("tests", tests, 1800 if full else 120, why_not=why_no_tests, is_pytest=True),
        Step("planted-compile", (*planted, "compile", *(["--emulate"] if stub else [])), 30, skip_codes=(2,)),
        Step("planted-wrong", (*planted, "wrong", *(["--emulate"] if stub else [])), 30, skip_codes=(2,)),
        Step("bench", tuple(bench), 900 if full else 75),
    ]
    return steps


def step_env(out: Path, environ: dict[str, str]) -> dict[str, str]:
    """What every step runs with: a fresh decision cache, no CPU extension build, no network, no TRILLM_KERNELS."""
    env = dict(environ)
    env.pop("TRILLM_KERNELS", None)
    env.update({
        "TRILLM_KERNEL_CACHE": str(out / "kernel-cache"),  # decisions of this run only, never ~/.cache
        "TRILLM_CPU_EXT": "0",  # the GPU back-ends never use it: no C++ build on the GPU's clock
        "PYTHONUNBUFFERED": "1", "PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        NESTED_ENV: "1",
    })  # fmt: skip
    return env


def run(steps: list[Step], out: Path, env: dict[str, str], deadline_s: float) -> list[Result]:
    deadline = time.monotonic() + deadline_s
    results: list[Result] = []
    for step in steps:
        if results and results[0].status != "PASS":
            results.append(Result(step.name, "SKIP", 0.0, f"env {results[0].status}: {results[0].detail}"))
            continue
        results.append(run_step(step, out, env, deadline))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: 8-minute deadline")
    mode.add_argument("--full", action="store_true", help="60-minute deadline, all of tests/kernels, full bench")
    parser.add_argument("results", nargs="?", type=Path, help="same as --out")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/gpu-check)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with mlx and trillm")
    parser.add_argument("--stub", action="store_true", help="dry run without a GPU (see the module docstring)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for all steps together")
    parser.add_argument("--steps", default=None, help="comma-separated subset of the steps (env always runs)")
    args = parser.parse_args(argv)
    out = (args.out or args.results or ROOT / "results" / "gpu-check").resolve()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "kernel-cache", ignore_errors=True)  # every run checks and times afresh
    environ = dict(os.environ)
    steps = plan(args.python, out, full=args.full, stub=args.stub, in_pytest=inside_pytest(environ),
                 system=platform.system())  # fmt: skip
    if args.steps:
        wanted = {"env", *args.steps.split(",")}
        if unknown := wanted - {s.name for s in steps}:
            parser.error(f"unknown steps {sorted(unknown)}; these exist here: {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in wanted]
    deadline_s = args.deadline or (FULL_DEADLINE_S if args.full else QUICK_DEADLINE_S)
    print(f"gpu_check {'full' if args.full else 'quick'}{' (stub)' if args.stub else ''}: deadline {deadline_s:.0f} s, "
          f"results in {out}", flush=True)  # fmt: skip
    t0 = time.monotonic()
    results = run(steps, out, step_env(out, environ), deadline_s)
    lines = [f"{r.name:<16} {r.status:<4} {r.seconds:7.1f} s  {r.detail}" for r in results]
    lines.append(f"total {time.monotonic() - t0:.1f} s of a {deadline_s:.0f} s deadline")
    line = verdict(results)
    (out / "summary.txt").write_text("\n".join([*lines, line]) + "\n")
    (out / "verdict.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    print("\n".join(lines))
    print(line, flush=True)
    return {"PASS": 0, "FAIL": 1}.get(line.split()[1], 2)


if __name__ == "__main__":
    raise SystemExit(main())
