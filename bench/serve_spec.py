"""`trillm bench serve-spec`: speculative decoding through the server: two `trillm serve` of one model, one with
`--speculative` and one without, measured side by side over HTTP like `bench serve`.

Three cases: a code edit (the prompt holds a file, the answer rewrites it) and plain chat one request at a time,
and chat at c=16. Each case runs on both servers in turn (the order alternates case by case). Reports each
server's output tok/s, TTFT and TPOT, the speculating server's acceptance rate and tokens per forward over the
case (from its /stats before and after), and whether the two servers' greedy texts are identical per request.
The engine without HTTP is `bench engine --speculative`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from trillm.bench.harness import report
from trillm.bench.harness.arrival import Arrival
from trillm.bench.harness.client import GenerationOptions, Target, send_sse
from trillm.bench.harness.metrics import Summary
from trillm.bench.harness.results import new_results_dir, write_json, write_meta, write_text_atomic
from trillm.bench.harness.run import RunResult, run_workload
from trillm.bench.harness.servers import ServerProcess, free_port, trillm_command
from trillm.bench.harness.workloads import Workload, chat, code_edit

OFF, ON = "spec-off", "spec-on"
CASES = ("code-edit", "chat", "chat-c16")


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    workload: Workload
    arrival: Arrival


@dataclass(frozen=True, slots=True)
class SpecCounts:
    """A server's cumulative speculation counters (its /stats, summed over its models)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifies: int = 0

    def __sub__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(self.draft_tokens - other.draft_tokens, self.accepted_tokens - other.accepted_tokens,
                          self.verifies - other.verifies)

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
                          self.verifies + other.verifies)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a speculating row got per verify forward (1.0: nothing speculated)."""
        return 1.0 + self.accepted_tokens / self.verifies if self.verifies else 1.0

    @classmethod
    def of_stats(cls, doc: dict[str, Any]) -> SpecCounts:
        total = cls()
        for m in doc.get("models") or []:
            e = m.get("engine") or {}
            total += cls(int(e.get("spec_draft_tokens", 0)), int(e.get("spec_accepted_tokens", 0)),
                         int(e.get("spec_verifies", 0)))
        return total


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One case on both servers: the best trial of each, the counters over all trials, the texts compared."""

    case: str
    concurrency: int
    num_requests: int
    off: Summary
    on: Summary
    spec: SpecCounts
    differing: tuple[str, ...]  # request ids whose texts differ (or that failed on either), over all trials

    @property
    def ratio(self) -> float:
        return self.on.output_throughput / self.off.output_throughput if self.off.output_throughput else float("nan")

    @property
    def identical(self) -> bool:
        return not self.differing


def differing_texts(a: RunResult, b: RunResult) -> list[str]:
    """Request ids whose generated texts differ between two runs of one workload; a failure counts as differing."""
    texts_b = {r.request_id: r.text if r.success else None for r in b.records}
    out = []
    for r in a.records:
        other = texts_b.pop(r.request_id, None)
        if not r.success or r.text is None or other is None or r.text != other:
            out.append(r.request_id)
    return sorted(out + list(texts_b))


def plan(args: argparse.Namespace) -> list[Case]:
    only = args.only or list(CASES)
    cases = []
    if "code-edit" in only:
        cases.append(Case("code-edit", code_edit(args.code_prompts, args.code_tokens, args.seed),
                          Arrival("concurrency", 1)))
    if "chat" in only:
        cases.append(Case("chat", chat(args.chat_prompts, args.chat_tokens, args.seed), Arrival("concurrency", 1)))
    if "chat-c16" in only:
        cases.append(Case("chat-c16", chat(args.high_prompts, args.chat_tokens, args.seed + 1),
                          Arrival("concurrency", args.high_concurrency)))
    return cases


async def spec_counts(client: httpx.AsyncClient, target: Target) -> SpecCounts:
    resp = await client.get(target.url + "/stats")
    resp.raise_for_status()
    return SpecCounts.of_stats(resp.json())


async def warm_up(targets: list[Target], opts: GenerationOptions, n: int) -> None:
    """Unrecorded short code edits and chats on each server, so first-call costs stay out of the numbers."""
    async with httpx.AsyncClient(timeout=opts.timeout_s) as client:
        for t in targets:
            for req in code_edit(n, 24).requests + chat(n, 16).requests:
                rec = await send_sse(client, t, req, opts, 0.0)
                if not rec.success:
                    raise SystemExit(f"{t.name}: the warm-up request failed: {rec.error}")


async def run_cases(targets: dict[str, Target], cases: list[Case], opts: GenerationOptions, trials: int,
                    warmup: int, progress: bool) -> tuple[list[CaseResult], list[RunResult]]:
    await warm_up(list(targets.values()), opts, warmup)
    results, all_runs = [], []
    k = 0
    async with httpx.AsyncClient(timeout=30.0) as stats_client:
        for case in cases:
            runs: dict[str, list[RunResult]] = {OFF: [], ON: []}
            spec = SpecCounts()
            for _ in range(trials):
                order = [OFF, ON] if k % 2 == 0 else [ON, OFF]
                k += 1
                for name in order:
                    before = await spec_counts(stats_client, targets[name])
                    res = await run_workload(targets[name], case.workload, case.arrival, opts, progress=progress)
                    if name == ON:
                        spec += await spec_counts(stats_client, targets[name]) - before
                    runs[name].append(res)
                    s = res.summary
                    print(f"{name:>8} {case.name:>9} {case.arrival.label:>4}: {s.completed}/{len(res.records)} ok, "
                          f"{s.output_throughput:6.1f} out tok/s, TTFT p50 {s.ttft.p50:6.0f} ms, TPOT mean "
                          f"{s.tpot.mean:6.1f} ms", file=sys.stderr, flush=True)
            differ = sorted({rid for a, b in zip(runs[OFF], runs[ON]) for rid in differing_texts(a, b)})
            best = {n: max(rs, key=lambda r: r.summary.output_throughput).summary for n, rs in runs.items()}
            results.append(CaseResult(case.name, case.arrival.max_concurrency or 1, len(case.workload.requests),
                                      best[OFF], best[ON], spec, tuple(differ)))
            all_runs += runs[OFF] + runs[ON]
    return results, all_runs


def markdown(results: list[CaseResult]) -> str:
    rows = ["| case | c | requests | off out tok/s | on out tok/s | ratio | off TTFT p50 ms | on TTFT p50 ms | "
            "off TPOT ms | on TPOT ms | acceptance | tokens/forward | greedy identical |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        same = "yes" if r.identical else f"NO ({len(r.differing)}: {', '.join(r.differing)})"
        rows.append(f"| {r.case} | {r.concurrency} | {r.num_requests} | {r.off.output_throughput:.1f} | "
                    f"{r.on.output_throughput:.1f} | {r.ratio:.2f}x | {r.off.ttft.p50:.0f} | {r.on.ttft.p50:.0f} | "
                    f"{r.off.tpot.mean:.1f} | {r.on.tpot.mean:.1f} | {r.spec.acceptance_rate:.2f} | "
                    f"{r.spec.tokens_per_forward:.2f} | {same} |")
    return "\n".join(rows) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trillm bench serve-spec", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="what both servers serve (default: trillm serve's own default)")
    p.add_argument("--speculative", default="ngram", help="the speculating server's --speculative")
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--serve-args", default="", help="extra `trillm serve` flags for both servers (one string)")
    p.add_argument("--port-off", type=int, default=0, help="0: a free port")
    p.add_argument("--port-on", type=int, default=0, help="0: a free port")
    p.add_argument("--only", action="append", choices=CASES, default=None, help="repeatable (default: all)")
    p.add_argument("--code-prompts", type=int, default=3, help="code edits, one at a time")
    p.add_argument("--code-tokens", type=int, default=160, help="a code edit's max_tokens")
    p.add_argument("--chat-prompts", type=int, default=4, help="chats one at a time")
    p.add_argument("--chat-tokens", type=int, default=128, help="a chat's max_tokens")
    p.add_argument("--high-prompts", type=int, default=16, help="chats in the concurrent case")
    p.add_argument("--high-concurrency", type=int, default=16)
    p.add_argument("--trials", type=int, default=1, help="runs of each case per server (best tok/s reported)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded code edits and chats per server first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--no-progress", action="store_true")
    return p


def servers(args: argparse.Namespace, out: Path) -> dict[str, ServerProcess]:
    extra = shlex.split(args.serve_args)
    spec = ["--speculative", args.speculative, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    port_off, port_on = args.port_off or free_port(), args.port_on or free_port()
    return {OFF: ServerProcess(OFF, trillm_command(args.model, port_off, extra), port_off, out / f"{OFF}.log"),
            ON: ServerProcess(ON, trillm_command(args.model, port_on, [*extra, *spec]), port_on, out / f"{ON}.log")}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.trials < 1:
        raise SystemExit("--trials must be at least 1")
    cases = plan(args)
    out = new_results_dir(args.results_dir)
    write_meta(out, "bench serve-spec", list(sys.argv[1:] if argv is None else argv), vars(args))
    procs = servers(args, out)
    opts = GenerationOptions(temperature=0.0, timeout_s=args.timeout, keep_text=True)
    try:
        for sp in procs.values():
            sp.start()
        for sp in procs.values():
            print(f"{sp.name}: ready after {sp.wait_ready(args.startup_timeout):.1f}s at {sp.url}", file=sys.stderr)
        targets = {n: Target(n, sp.url) for n, sp in procs.items()}
        results, runs = trio.run(run_cases, targets, cases, opts, args.trials, args.warmup, not args.no_progress)
    finally:
        for sp in procs.values():
            sp.stop()
    table = markdown(results)
    report.write_all(out, runs, "serve", {"workloads": {c.name: c.workload.params for c in cases}})
    write_json(out / "serve-spec.json", {"speculative": args.speculative,
                                          "num_speculative_tokens": args.num_speculative_tokens,
                                          "cases": [asdict(r) | {"ratio": r.ratio, "spec": asdict(r.spec) | {
                                              "acceptance_rate": r.spec.acceptance_rate,
                                              "tokens_per_forward": r.spec.tokens_per_forward}}
                                                    for r in results]})
    write_text_atomic(out / "serve-spec.md", table)
    print(table)
    print(f"results: {out}")
    failed = sum(r.summary.failed for r in runs)
    if failed:
        print(f"{failed} request(s) failed; see {out}", file=sys.stderr)
        return 1
    if not all(r.identical for r in results):
        print("greedy texts differ between the servers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
