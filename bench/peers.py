"""`trillm bench peers`: trillm, mlx_lm.server and llama.cpp's server side by side on the same fp32 weights.

All of them (plus a trillm with its prefix cache off, for the multi-turn target) run on loopback; every
workload runs against each in turn, alternating the order, and the ratios are checked against the project's
targets. llama.cpp (llama-cpp-python's server on an F32 GGUF of the same model) is optional: it runs when an
interpreter with it is found (`trillm bench llama-cpp install` builds one) and is skipped, said once, when not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import trio

from trillm.bench import llama_cpp
from trillm.bench.harness import report
from trillm.bench.harness.arrival import Arrival
from trillm.bench.harness.client import GenerationOptions, Target
from trillm.bench.harness.metrics import Summary
from trillm.bench.harness.results import new_results_dir, write_meta
from trillm.bench.harness.run import RunResult
from trillm.bench.serve import run_matrix
from trillm.bench.harness.servers import ServerProcess, free_port, mlx_lm_command, trillm_command
from trillm.bench.harness.workloads import Workload, fixed, multi_turn, random_lengths

TRILLM, MLX_LM, NO_CACHE, LLAMA_CPP = "trillm", "mlx_lm.server", "trillm-no-cache", "llama.cpp"
HIGH = "high-concurrency"  # the targets are set at concurrency 32 (--high-concurrency)
SINGLE, MULTI_TURN, PREFILL = "single-stream", "multi-turn", "long-prompt"


@dataclass(frozen=True, slots=True)
class TargetCheck:
    """One of the targets, as measured."""

    workload: str
    metric: str
    ours: float
    theirs: float
    ratio: float | None
    target: str
    passed: bool | None  # None: not measured, or a ratio only reported (target "report")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def check_targets(summaries: dict[tuple[str, str], Summary]) -> list[TargetCheck]:
    """The targets (and the ratios only reported) from the runs keyed by (workload label, server)."""
    out: list[TargetCheck] = []

    def add(wl: str, metric: str, num: str, den: str, attr: str, target: str,
            ok: Callable[[float], bool] | None) -> None:
        ours, theirs = summaries.get((wl, num)), summaries.get((wl, den))
        if ours is None or theirs is None:
            out.append(TargetCheck(wl, metric, float("nan"), float("nan"), None, target, None))
            return
        a, b = _get(ours, attr), _get(theirs, attr)
        r = _ratio(a, b)
        out.append(TargetCheck(wl, metric, a, b, r, target, None if r is None or ok is None else ok(r)))

    add(HIGH, "output tok/s, trillm / mlx_lm.server", TRILLM, MLX_LM, "output_throughput", ">= 1.5",
        lambda r: r >= 1.5)
    add(HIGH, "TTFT p90 ms, trillm / mlx_lm.server", TRILLM, MLX_LM, "ttft.p90", "<= 0.5", lambda r: r <= 0.5)
    add(SINGLE, "output tok/s, trillm / mlx_lm.server", TRILLM, MLX_LM, "output_throughput", ">= 1.0",
        lambda r: r >= 1.0)
    # "TTFT 3x better": cache-off TTFT over cache-on TTFT, so the ratio reads as the speed-up.
    add(MULTI_TURN, "TTFT mean ms, trillm-no-cache / trillm", NO_CACHE, TRILLM, "ttft.mean", ">= 3.0",
        lambda r: r >= 3.0)
    # llama.cpp: the stretch goal is its single-stream speed; the rest is reported. On a long prompt with one
    # output token, their TTFT over ours reads as the prefill speed-up.
    add(SINGLE, "output tok/s, trillm / llama.cpp", TRILLM, LLAMA_CPP, "output_throughput", ">= 1.0 (stretch)",
        lambda r: r >= 1.0)
    add(HIGH, "output tok/s, trillm / llama.cpp", TRILLM, LLAMA_CPP, "output_throughput", "report", None)
    add(HIGH, "TTFT p90 ms, trillm / llama.cpp", TRILLM, LLAMA_CPP, "ttft.p90", "report", None)
    add(PREFILL, "TTFT mean ms, llama.cpp / trillm", LLAMA_CPP, TRILLM, "ttft.mean", "report", None)
    add(PREFILL, "TTFT mean ms, mlx_lm.server / trillm", MLX_LM, TRILLM, "ttft.mean", "report", None)
    return out


def _get(s: Summary, attr: str) -> float:
    obj: object = s
    for part in attr.split("."):
        obj = getattr(obj, part)
    return float(obj)  # type: ignore[arg-type]


def targets_markdown(checks: list[TargetCheck], failures: dict[str, Summary] | None = None) -> str:
    """The targets table, notes on failed requests, and one line per missed target."""
    failures = failures or {}
    rows = ["| workload | metric | numerator | denominator | ratio | target | result |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        if c.ratio is None:
            verdict = "not measured"
        elif c.passed is None:
            verdict = "reported"
        else:
            verdict = "met" if c.passed else "**MISSED**"
        ratio = "-" if c.ratio is None else f"{c.ratio:.2f}x"
        rows.append(f"| {c.workload} | {c.metric} | {c.ours:.1f} | {c.theirs:.1f} | {ratio} | {c.target} | {verdict} |")
    for name, s in sorted(failures.items()):
        rows.append(f"\nNote: {name} failed {s.failed} of {s.completed + s.failed} requests "
                    f"({', '.join(f'{k}={v}' for k, v in s.errors.items())}); its latencies and throughput cover only "
                    "the requests it served.")
    missed = [c for c in checks if c.passed is False]
    if missed:
        rows.append("")
        rows += [
            f"Target missed: {c.workload} {c.metric} = {c.ours:.1f} / {c.theirs:.1f} = {c.ratio:.2f}x, "
            f"target {c.target}."
            for c in missed
        ]
    return "\n".join(rows) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trillm bench peers", description=__doc__,
        epilog="Defaults are sized for a few minutes on 2 CPU cores; raise --high-prompts/--output-len on a GPU.",
    )
    p.add_argument("--model", default=None, help="HF-style MLX model folder (default: the bundled SmolLM2 "
                   "exported to fp32 under ~/.cache/trillm/mlx)")
    p.add_argument("--high-concurrency", type=int, default=32)
    p.add_argument("--high-prompts", type=int, default=32, help="requests in the high-concurrency run")
    p.add_argument("--single-prompts", type=int, default=4, help="requests in the single-stream run")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--conversations", type=int, default=4, help="multi-turn: conversations (run concurrently)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-len", type=int, default=192, help="multi-turn: system prompt words")
    p.add_argument("--turn-len", type=int, default=48, help="multi-turn: words per user and assistant turn")
    p.add_argument("--turn-output-len", type=int, default=16)
    p.add_argument("--prefill-prompts", type=int, default=3, help="long-prompt: requests (one at a time)")
    p.add_argument("--prefill-len", type=int, default=1000, help="long-prompt: words (about one token each), "
                   "one output token")
    p.add_argument("--only", action="append", choices=("concurrency", "single", "multi-turn", "prefill"),
                   default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--trillm-args", default="", help="extra `trillm serve` flags (one string)")
    p.add_argument("--no-cache-args", default="--no-prefix-caching",
                   help="the `trillm serve` flags that turn its prefix cache off")
    p.add_argument("--mlx-lm-args", default="", help="extra `mlx_lm server` flags (one string)")
    p.add_argument("--skip-mlx-lm", action="store_true")
    p.add_argument("--llama-cpp", choices=("auto", "on", "off"), default="auto",
                   help="llama.cpp's server as a peer: auto runs it when found, on fails without it")
    p.add_argument("--llama-cpp-python", default=None, help="an interpreter with llama-cpp-python[server] "
                   f"(default: ${llama_cpp.PYTHON_ENV}, then {llama_cpp.venv_dir()}/bin/python, then this one)")
    p.add_argument("--llama-cpp-gguf", default=None, help="the GGUF llama.cpp serves (default: the bundled "
                   "SmolLM2 dequantized to F32, cached; required with --model)")
    p.add_argument("--llama-cpp-threads", type=int, default=None, help="its decode and batch threads "
                   "(default: one per core)")
    p.add_argument("--llama-cpp-args", default="", help="extra `python -m llama_cpp.server` (or llama-server) "
                   "flags (one string)")
    p.add_argument("--llama-server", default=os.environ.get(llama_cpp.SERVER_BIN_ENV) or None,
                   help="llama.cpp's own llama-server binary, run instead of llama-cpp-python's server, with "
                   f"--parallel (default: ${llama_cpp.SERVER_BIN_ENV})")
    p.add_argument("--llama-server-parallel", type=int, default=None,
                   help="its --parallel slots (default: --high-concurrency)")
    p.add_argument("--skip-no-cache", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--no-progress", action="store_true")
    return p


def _plan(args: argparse.Namespace) -> list[tuple[str, Workload, Arrival, tuple[str, ...]]]:
    """(label, workload, arrival, servers) for every comparison the targets need."""
    only = set(args.only or ("concurrency", "single", "multi-turn", "prefill"))
    plan: list[tuple[str, Workload, Arrival, tuple[str, ...]]] = []
    if "concurrency" in only:
        wl = random_lengths(args.high_prompts, args.input_len, args.output_len, 0.0, args.seed)
        plan.append((HIGH, wl, Arrival("concurrency", args.high_concurrency), (TRILLM, MLX_LM, LLAMA_CPP)))
    if "single" in only:
        wl = random_lengths(args.single_prompts, args.input_len, args.output_len, 0.0, args.seed + 1)
        plan.append((SINGLE, wl, Arrival("concurrency", 1), (TRILLM, MLX_LM, LLAMA_CPP)))
    if "multi-turn" in only:
        wl = multi_turn(args.conversations, args.turns, args.turn_len, args.turn_len, args.turn_output_len,
                        args.system_len, args.seed + 2)
        plan.append((MULTI_TURN, wl, Arrival("concurrency", args.conversations), (TRILLM, NO_CACHE, MLX_LM)))
    if "prefill" in only:
        wl = fixed("long-prompt", args.prefill_prompts, args.prefill_len, 1, args.seed + 3)
        plan.append((PREFILL, wl, Arrival("concurrency", 1), (TRILLM, MLX_LM, LLAMA_CPP)))
    return plan


def _llama_cpp_process(args: argparse.Namespace, out: Path, model_given: bool) -> ServerProcess | None:
    """Its server process, or None (said once) when auto finds no interpreter or no GGUF for --model."""
    if args.llama_cpp == "off":
        return None
    gguf = args.llama_cpp_gguf
    python, why = None, None
    if gguf is None and model_given:
        why = "--model was given without --llama-cpp-gguf (the same weights as a GGUF)"
    elif args.llama_server is not None:
        if not os.access(args.llama_server, os.X_OK):
            why = f"--llama-server {args.llama_server} is not an executable file"
    elif (python := llama_cpp.find_python(args.llama_cpp_python)) is None:
        why = "no interpreter with llama-cpp-python[server] found; `trillm bench llama-cpp install` builds one"
    if why is not None:
        if args.llama_cpp == "on":
            raise SystemExit(f"trillm bench peers: --llama-cpp on: {why}")
        print(f"llama.cpp peer skipped: {why}", file=sys.stderr)
        return None
    if gguf is None:
        print("dequantizing the default model to an F32 GGUF for llama.cpp (cached) ...", file=sys.stderr)
        gguf = str(llama_cpp.export_f32_gguf())
    extra = shlex.split(args.llama_cpp_args)
    if args.llama_server is not None:
        cmd = llama_cpp.llama_server_command(args.llama_server, gguf, 0, threads=args.llama_cpp_threads, extra=extra,
                                             parallel=args.llama_server_parallel or args.high_concurrency)
        return ServerProcess(LLAMA_CPP, cmd, 0, out / "llama_server.log", env=llama_cpp.server_env())
    assert python is not None
    cmd = llama_cpp.llama_cpp_command(python, gguf, 0, threads=args.llama_cpp_threads, extra=extra)
    return ServerProcess(LLAMA_CPP, cmd, 0, out / "llama_cpp_server.log", env=llama_cpp.server_env(),
                         health_path=llama_cpp.HEALTH_PATH)


async def _run_plan(
    plan: list[tuple[str, Workload, Arrival, tuple[str, ...]]], targets: dict[str, Target], opts: GenerationOptions,
    args: argparse.Namespace,
) -> tuple[list[RunResult], dict[tuple[str, str], Summary]]:
    runs: list[RunResult] = []
    summaries: dict[tuple[str, str], Summary] = {}
    await run_matrix(list(targets.values()), [], [], opts, warmup=args.warmup, log=False)
    for i, (label, wl, arrival, names) in enumerate(plan):
        present = [targets[n] for n in names if n in targets]
        present = present[i % len(present):] + present[: i % len(present)]  # alternate who goes first
        for res in await run_matrix(present, [wl], [arrival], opts, seed=args.seed, progress=not args.no_progress,
                                    warmup=0):
            runs.append(res)
            summaries[(label, res.target.name)] = res.summary
    return runs, summaries


def main(argv: list[str] | None = None) -> int:
    """Start the servers, run the plan, print the table and the targets; results under results/<timestamp>/."""
    args = build_parser().parse_args(argv)
    out = new_results_dir(args.results_dir)
    model_given = args.model is not None
    if args.model is None:
        from trillm.bench.harness.export_mlx import export_gguf

        print("exporting the default model to an fp32 MLX folder (cached) ...", file=sys.stderr)
        args.model = str(export_gguf())
    model = str(Path(args.model).expanduser().resolve())
    write_meta(out, "bench peers", list(sys.argv[1:] if argv is None else argv), vars(args))
    plan = _plan(args)
    wanted = {n for *_, names in plan for n in names}
    procs = {TRILLM: ServerProcess(TRILLM, trillm_command(model, free_port(), shlex.split(args.trillm_args)),
                                   0, out / "trillm.log")}
    if NO_CACHE in wanted and not args.skip_no_cache:
        no_cache = shlex.split(args.trillm_args) + shlex.split(args.no_cache_args)
        procs[NO_CACHE] = ServerProcess(NO_CACHE, trillm_command(model, 0, no_cache), 0, out / "trillm-no-cache.log")
    if not args.skip_mlx_lm:
        procs[MLX_LM] = ServerProcess(MLX_LM, mlx_lm_command(model, 0, shlex.split(args.mlx_lm_args)), 0,
                                      out / "mlx_lm_server.log")
    if LLAMA_CPP in wanted and (lp := _llama_cpp_process(args, out, model_given)) is not None:
        procs[LLAMA_CPP] = lp
    for sp in procs.values():  # the port goes after "--port" in the command
        sp.port = free_port()
        sp.command[sp.command.index("--port") + 1] = str(sp.port)
    opts = GenerationOptions(temperature=0.0, timeout_s=args.timeout)
    with contextlib.ExitStack() as stack:
        for sp in procs.values():
            stack.enter_context(sp)
        for sp in procs.values():  # started together, waited on in turn
            waited = sp.wait_ready(args.startup_timeout)
            print(f"{sp.name} ready at {sp.url} after {waited:.1f}s", file=sys.stderr)
        targets = {name: Target(name, sp.url) for name, sp in procs.items()}
        runs, summaries = trio.run(_run_plan, plan, targets, opts, args)
    checks = check_targets(summaries)
    failures = {f"{name} ({label})": s for (label, name), s in summaries.items() if s.failed}
    table, tmd = report.markdown_table(runs), targets_markdown(checks, failures)
    extra: dict[str, object] = {
        "model": model,
        "commands": {n: sp.command for n, sp in procs.items()},
        "targets": [asdict(c) for c in checks],
        "workloads": {label: wl.params for label, wl, *_ in plan},
    }
    written = report.write_all(out, runs, "peers", extra)
    cmd = "trillm bench peers " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    (out / "peers.md").write_text(f"Command: `{cmd}`\n\n{table}\n## Targets\n\n{tmd}")
    print(table)
    print(tmd)
    print(f"results: {out}  ({', '.join(p.name for p in written.values())}, meta.json, *.log)")
    (out / "targets.json").write_text(json.dumps([asdict(c) for c in checks], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
