"""`trillm bench serve`: measure any OpenAI-compatible server (or several, alternating) like vLLM's benchmark."""

from __future__ import annotations

import argparse
import math
import sys

import httpx
import trio

from trillm.bench.harness import report
from trillm.bench.harness.arrival import Arrival
from trillm.bench.harness.client import TRANSPORTS, GenerationOptions, Target, send_sse, send_ws
from trillm.bench.harness.metrics import SLO
from trillm.bench.harness.results import new_results_dir, write_meta
from trillm.bench.harness.run import RunResult, run_workload
from trillm.bench.harness.workloads import WORKLOADS, BenchRequest, Workload, WorkloadSpec, build


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `bench serve` and `bench peers`."""
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=32, help="requests per workload (turns included)")
    g.add_argument("--input-len", type=int, default=128, help="random/multi-turn prompt words (~tokens)")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    g.add_argument("--range-ratio", type=float, default=0.5, help="random: lengths in len*(1 +- r)")
    g.add_argument("--short-len", type=int, default=32)
    g.add_argument("--long-len", type=int, default=1024)
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--system-len", type=int, default=512, help="shared-prefix/multi-turn system prompt words")
    g.add_argument("--sharegpt-scale", type=float, default=1.0, help="sharegpt: scales both mean lengths")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("requests")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos (servers may ignore it)")
    g.add_argument("--keep-text", action="store_true",
                   help="keep each request's generated text in the results (to compare servers' greedy outputs)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--warmup", type=int, default=1, help="unrecorded short requests per server first")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    g.add_argument("--results-dir", default="results", help="runs go under RESULTS_DIR/<timestamp>/")
    g.add_argument("--no-progress", action="store_true")


def add_arrival_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("arrival (one of)")
    g.add_argument("--concurrency", type=int, nargs="+", default=None, help="max concurrency; several = a sweep")
    g.add_argument("--request-rate", type=float, nargs="+", default=None, help="requests/s (Poisson/gamma)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    g.add_argument("--burst", action="store_true", help="open every connection at once")


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, short_len=args.short_len, long_len=args.long_len, num_turns=args.num_turns,
        system_len=args.system_len, scale=args.sharegpt_scale, seed=args.seed,
    )


def options_from_args(args: argparse.Namespace) -> GenerationOptions:
    return GenerationOptions(temperature=args.temperature, ignore_eos=args.ignore_eos, timeout_s=args.timeout,
                             keep_text=args.keep_text)


def slo_from_args(args: argparse.Namespace) -> SLO | None:
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    return SLO(args.slo_ttft_ms, args.slo_tpot_ms)


def arrivals_from_args(args: argparse.Namespace) -> list[Arrival]:
    if args.burst and (args.concurrency or args.request_rate):
        raise SystemExit("--burst opens every connection at once; it takes no --concurrency or --request-rate")
    if args.request_rate and args.concurrency and len(args.concurrency) > 1:
        raise SystemExit("--request-rate takes at most one --concurrency (a cap)")
    if args.burst:
        return [Arrival("burst")]
    if args.request_rate:
        cap = args.concurrency[0] if args.concurrency else None
        return [Arrival("rate", cap, r if r > 0 else math.inf, args.burstiness) for r in args.request_rate]
    return [Arrival("concurrency", c) for c in (args.concurrency or [1])]


async def warm_up(target: Target, opts: GenerationOptions, n: int) -> None:
    """Unrecorded requests so one-time costs (compilation, first allocation) stay out of the numbers."""
    async with httpx.AsyncClient(timeout=opts.timeout_s) as client:
        for i in range(n):
            req = BenchRequest(f"warmup-{i}", 4, prompt="Hello there, how are you", prompt_words=5)
            if target.transport == "ws":
                await send_ws(target, req, opts, 0.0)
            else:
                await send_sse(client, target, req, opts, 0.0)


async def run_matrix(
    targets: list[Target],
    workloads: list[Workload],
    arrivals: list[Arrival],
    opts: GenerationOptions,
    *,
    slo: SLO | None = None,
    seed: int = 0,
    progress: bool = True,
    warmup: int = 1,
    log: bool = True,
) -> list[RunResult]:
    """Every workload x arrival on every target; the target order rotates each time to spread drift evenly."""
    for t in targets:
        await warm_up(t, opts, warmup)
    runs: list[RunResult] = []
    k = 0
    for wl in workloads:
        for arrival in arrivals:
            order = targets[k % len(targets):] + targets[: k % len(targets)]
            k += 1
            for t in order:
                res = await run_workload(t, wl, arrival, opts, slo=slo, seed=seed, progress=progress)
                runs.append(res)
                if log:
                    s = res.summary
                    print(
                        f"{t.name:>14} {wl.name:>13} {arrival.label:>8}: {s.completed}/{len(res.records)} ok, "
                        f"{s.output_throughput:7.1f} out tok/s, TTFT p50 {s.ttft.p50:7.0f} ms, "
                        f"TPOT mean {s.tpot.mean:6.1f} ms, errors {s.errors or '-'}",
                        file=sys.stderr, flush=True,
                    )
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trillm bench serve", description=__doc__)
    p.add_argument("--url", action="append", required=True, help="server base URL; repeat for several")
    p.add_argument("--name", action="append", default=None, help="label per --url (default host:port)")
    p.add_argument("--model", default=None, help="model name to send (default: none; servers use their own)")
    p.add_argument("--api-key", default=None, help="Bearer token for servers that require one")
    p.add_argument("--transport", choices=TRANSPORTS, default="sse", help="ws: trillm's /v1/ws API")
    p.add_argument("--api", choices=("auto", "chat", "completions"), default="auto",
                   help="auto: chat for chat workloads, /v1/completions otherwise")
    p.add_argument("--workload", action="append", choices=WORKLOADS, default=None, help="repeatable")
    add_workload_args(p)
    add_arrival_args(p)
    return p


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    names = args.name or []
    if names and len(names) != len(args.url):
        raise SystemExit("give one --name per --url, or none")
    out = []
    for i, url in enumerate(args.url):
        name = names[i] if names else httpx.URL(url).netloc.decode()
        out.append(Target(name, url, args.transport, args.model, args.api, args.api_key))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run `bench serve`; writes serve.json, serve.md, plots and meta.json under the results folder."""
    args = build_parser().parse_args(argv)
    targets = targets_from_args(args)
    arrivals = arrivals_from_args(args)
    spec = spec_from_args(args)
    workloads = [build(w, spec) for w in (args.workload or ["random"])]
    out = new_results_dir(args.results_dir)
    write_meta(out, "bench serve", list(sys.argv[1:] if argv is None else argv), vars(args))
    runs = trio.run(
        lambda: run_matrix(
            targets, workloads, arrivals, options_from_args(args), slo=slo_from_args(args), seed=args.seed,
            progress=not args.no_progress, warmup=args.warmup,
        )
    )
    written = report.write_all(out, runs, "serve", {"workloads": {w.name: w.params for w in workloads}})
    print(report.markdown_table(runs))
    print(f"results: {out}  ({', '.join(p.name for p in written.values())})")
    failed = sum(r.summary.failed for r in runs)
    if failed:
        print(f"{failed} request(s) failed; see errors above and in {written['json']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
