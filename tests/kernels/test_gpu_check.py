"""kernels/tools/gpu_check.sh: the prepared GPU check, dry-run here with a stub back-end.

Never the suite inside the suite: under pytest the check's `tests` step is SKIP (it would run pytest again),
so on a GPU machine these tests run only the script's own steps. The step runner (limits, the deadline,
SKIP vs FAIL, the verdict) is tested on small shell commands.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kernels" / "tools" / "gpu_check.sh"


def _load() -> ModuleType:
    """gpu_check.py as the script runs it: a file, not a package module."""
    spec = importlib.util.spec_from_file_location("gpu_check_file", ROOT / "kernels" / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = _load()


def _gpu_here() -> bool:
    from trillm.kernels.backend import kernel_backend

    return kernel_backend() in ("metal", "cuda")


def _run(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), *args, "--out", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=gc.QUICK_DEADLINE_S + 60)  # fmt: skip
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("VERDICT: "), proc.stdout[-3000:] + proc.stderr[-3000:]
    statuses = dict(item.split("=") for item in last[last.index("(") + 1 : -1].split())
    return proc, statuses


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the stub's planted checks run through the g++ emulator")
def test_quick_stub_dry_run_finishes_in_time_with_one_verdict_line(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc, statuses = _run("--quick", "--stub", tmp_path=tmp_path)
    assert time.monotonic() - t0 < gc.QUICK_DEADLINE_S
    assert list(statuses) == ["env", *(["compile"] if sys.platform == "darwin" else []), "selfcheck", "tests",
                              "planted-compile", "planted-wrong", "bench"]  # fmt: skip
    assert statuses["tests"] == "SKIP"  # inside pytest: never the suite inside the suite
    assert all(statuses[s] == "PASS" for s in ("env", "selfcheck", "planted-compile", "planted-wrong", "bench")), proc.stdout
    assert proc.returncode == 2 and proc.stdout.strip().splitlines()[-1].startswith("VERDICT: SKIP")
    summary = (tmp_path / "summary.txt").read_text()
    assert "inside pytest" in summary
    assert "caught and fallen back" in (tmp_path / "planted-compile.txt").read_text()
    assert "caught and fallen back" in (tmp_path / "planted-wrong.txt").read_text()
    assert list(tmp_path.glob("kernels-*/bench_kernels.json"))


def test_env_step_here(tmp_path: Path) -> None:
    """The real env step alone (never the whole check inside the suite): PASS on a GPU, SKIP elsewhere."""
    proc, statuses = _run("--quick", "--steps", "env", tmp_path=tmp_path)
    assert statuses == {"env": "PASS" if _gpu_here() else "SKIP"}, proc.stdout
    if not _gpu_here():
        assert proc.returncode == 2 and "no Metal/CUDA back-end" in (tmp_path / "env.txt").read_text()


def test_without_a_gpu_every_step_is_skip(tmp_path: Path) -> None:
    if _gpu_here():
        pytest.skip("a GPU is here: the whole quick check is gpu_check.sh's to run, not the suite's")
    proc, statuses = _run("--quick", tmp_path=tmp_path)
    assert set(statuses.values()) == {"SKIP"} and proc.returncode == 2, proc.stdout


def test_the_quick_plan_fits_the_deadline_and_does_no_cpu_only_work(tmp_path: Path) -> None:
    for system in ("Linux", "Darwin"):
        steps = gc.plan("py", tmp_path, full=False, stub=False, in_pytest=False, system=system)
        names = [s.name for s in steps]
        assert ("compile" in names) == (system == "Darwin")  # nvcc and the CPU extension: the CPU machine's work
        text = " ".join(" ".join(s.cmd) for s in steps)
        for cpu_only in ("cuda_compile", "pip", "cpu_ext", "test_kernels_emulated", "nvcc"):
            assert cpu_only not in text
        if system == "Linux":
            assert sum(s.cap_s for s in steps) <= gc.QUICK_DEADLINE_S
    steps = {s.name: s for s in gc.plan("py", tmp_path, full=False, stub=False, in_pytest=False, system="Linux")}
    assert "tests/kernels/test_kernels_vs_ref.py" in steps["tests"].cmd and steps["tests"].why_not is None
    assert "--noconftest" in steps["tests"].cmd  # the root conftest would load the engine and mlx-lm
    bench = steps["bench"].cmd
    assert bench[bench.index("--contexts") + 1] == "512,4096" and bench[bench.index("--batches") + 1] == "1,64"
    nested = {s.name: s for s in gc.plan("py", tmp_path, full=True, stub=False, in_pytest=True, system="Linux")}
    assert nested["tests"].why_not is not None and "inside pytest" in nested["tests"].why_not
    full = {s.name: s for s in gc.plan("py", tmp_path, full=True, stub=False, in_pytest=False, system="Linux")}
    assert "--ignore=tests/kernels/test_gpu_check.py" in full["tests"].cmd  # the full run skips this very file


def test_every_step_runs_nested_and_offline(tmp_path: Path) -> None:
    env = gc.step_env(tmp_path, {"TRILLM_KERNELS": "ref", "PATH": "/bin"})
    assert "TRILLM_KERNELS" not in env and env["TRILLM_CPU_EXT"] == "0" and env["PIP_NO_INDEX"] == "1"
    assert env["TRILLM_KERNEL_CACHE"] == str(tmp_path / "kernel-cache")
    assert gc.inside_pytest(env)  # a check started by a step would run no tests
    assert not gc.inside_pytest({"PATH": "/bin"})


def _step(name: str, script: str, cap: float = 20, **kw: object) -> object:
    return gc.Step(name, ("sh", "-c", script), cap, **kw)


def test_step_statuses(tmp_path: Path) -> None:
    env = dict(os.environ)
    far = time.monotonic() + 100
    assert gc.run_step(_step("ok", "echo hi"), tmp_path, env, far).status == "PASS"
    assert (tmp_path / "ok.txt").read_text() == "hi\n"
    assert gc.run_step(_step("bad", "exit 3"), tmp_path, env, far).status == "FAIL"
    missing = gc.run_step(_step("missing", f"exit {gc.SKIP_CODE}"), tmp_path, env, far)
    assert missing.status == "SKIP" and "prerequisite" in missing.detail
    all_skipped = gc.run_step(_step("pt", "echo '3 skipped in 0.1s'", is_pytest=True), tmp_path, env, far)
    assert all_skipped.status == "SKIP"
    assert gc.run_step(_step("pt2", "echo '3 passed in 0.1s'", is_pytest=True), tmp_path, env, far).status == "PASS"
    late = gc.run_step(_step("late", "echo never"), tmp_path, env, time.monotonic() + gc.MIN_STEP_S - 1)
    assert late.status == "SKIP" and "deadline" in late.detail and not (tmp_path / "late.txt").exists()


def test_a_step_past_its_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    t0 = time.monotonic()
    step = _step("hang", f"sleep 60 & echo $! > {pid_file}; wait", cap=1)
    result = gc.run_step(step, tmp_path, dict(os.environ), time.monotonic() + 100)
    assert result.status == "FAIL" and "timed out" in result.detail
    assert time.monotonic() - t0 < 15
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not _alive(child)  # the grandchild went with the step: nothing left holding the GPU


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is dead: it holds nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_verdict() -> None:
    R = gc.Result
    assert gc.verdict([R("env", "PASS", 0, ""), R("bench", "PASS", 0, "")]) == "VERDICT: PASS (env=PASS bench=PASS)"
    assert gc.verdict([R("env", "PASS", 0, ""), R("tests", "SKIP", 0, "")]).startswith("VERDICT: SKIP")
    assert gc.verdict([R("env", "PASS", 0, ""), R("tests", "SKIP", 0, ""), R("b", "FAIL", 0, "")]).startswith("VERDICT: FAIL")


def test_after_a_failed_env_nothing_runs(tmp_path: Path) -> None:
    steps = [_step("env", "exit 1"), _step("next", f"touch {tmp_path / 'ran'}")]
    results = gc.run(steps, tmp_path, dict(os.environ), 100)
    assert [r.status for r in results] == ["FAIL", "SKIP"] and not (tmp_path / "ran").exists()
