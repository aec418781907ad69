"""`trillm bench router`: KV-aware routing against round-robin over mock replicas, and the router's overhead.

    trillm bench router [--replicas 4] [--policy kv --policy round-robin] [--workload multi-turn ...]

For each workload and policy it starts N fresh `trillm serve --mock` processes (empty caches) and one
`trillm route --policy P` in front of them, drives the workload through the router with the same client as
`trillm bench serve` (sessions' turns in order, a fixed concurrency), and records the prefix hit rate (usage
cached_tokens over prompt tokens), TTFT p50/p90, throughput and the router's own decision time (request read
-> upstream request sent, from its /stats). Then the overhead pass: one fast replica, requests sent
alternately straight to it and through the router, one at a time: the TTFT the extra hop adds, and the
router process's CPU time per request. Targets: >= 2x the cached tokens of round-robin on multi-turn, and
router overhead under 2 ms per request at p50. Each policy runs --trials times in rotating order (the figures
are the medians). Writes router.json and router.md under RESULTS_DIR/<timestamp>/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from trillm.bench.harness.arrival import Arrival
from trillm.bench.harness.client import GenerationOptions, Target
from trillm.bench.harness.metrics import Stat
from trillm.bench.harness.results import new_results_dir, write_json, write_meta, write_text_atomic
from trillm.bench.harness.run import RunResult, run_workload
from trillm.bench.harness.servers import ServerProcess, ServerStartError, free_port
from trillm.bench.harness.workloads import Workload, WorkloadSpec, build

POLICIES = ("kv", "round-robin", "least-loaded")
WORKLOADS = ("multi-turn", "shared-prefix")


class NothingMeasured(RuntimeError):
    """A run produced no usable numbers: the benchmark must fail, not print defaults."""


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), or None where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Fleet:
    """N mock replicas and a router, as child processes."""

    replicas: list[ServerProcess]
    router: ServerProcess

    @classmethod
    def start(cls, out: Path, tag: str, n: int, policy: str, replica_flags: list[str],
              router_flags: list[str]) -> Fleet:
        replicas = []
        for i in range(n):
            port = free_port()
            cmd = [sys.executable, "-m", "trillm.web.cli", "serve", "--mock", "--port", str(port), *replica_flags]
            replicas.append(ServerProcess(f"replica{i}", cmd, port, out / "logs" / f"{tag}-replica{i}.log"))
        port = free_port()
        cmd = [sys.executable, "-m", "trillm.web.cli", "route", "--port", str(port), "--policy", policy,
               "--log-level", "warning", *router_flags, *(a for r in replicas for a in ("--replica", r.url))]
        fleet = cls(replicas, ServerProcess("router", cmd, port, out / "logs" / f"{tag}-router.log"))
        try:
            for proc in (*fleet.replicas, fleet.router):
                proc.start()
            for proc in (*fleet.replicas, fleet.router):
                proc.wait_ready(120)
            fleet.wait_synced()
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def wait_synced(self, timeout_s: float = 60.0) -> None:
        """Until every replica is in the pool with its KV-event stream started and its tokenizer decided."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            st = httpx.get(self.router.url + "/stats", timeout=5).json()
            workers = [w for r in st["replicas"] if r["health"] == "healthy" for w in r["workers"]]
            if (len(workers) == len(self.replicas) and all(w["synced"] and w["model_id"] for w in workers)
                    and st["tokenizers"] and "checking" not in st["tokenizers"].values()):
                return
            time.sleep(0.1)
        raise ServerStartError(f"the router did not sync with its replicas in {timeout_s:.0f} s")

    def stop(self) -> None:
        for proc in (self.router, *self.replicas):
            proc.stop()


def hit_rate(run: RunResult) -> float:
    s = run.summary
    return s.cached_tokens / s.input_tokens if s.input_tokens else 0.0


def check_measured(run: RunResult, stats: dict[str, Any]) -> None:
    s = run.summary
    if s.completed == 0:
        raise NothingMeasured(f"{run.target.name} {run.workload}: no request completed ({s.errors})")
    if s.usage_reported == 0 or s.input_tokens == 0:
        raise NothingMeasured(f"{run.target.name} {run.workload}: the replicas reported no usage")
    if stats["overhead"]["decisions"] == 0:
        raise NothingMeasured(f"{run.target.name} {run.workload}: the router recorded no decision")


async def drive(router_url: str, name: str, workload: Workload, concurrency: int, opts: GenerationOptions,
                progress: bool) -> tuple[RunResult, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as client:
        await client.post(router_url + "/stats/reset")
    run = await run_workload(Target(name, router_url), workload, Arrival("concurrency", concurrency), opts,
                             progress=progress)
    async with httpx.AsyncClient(timeout=10) as client:
        stats = (await client.get(router_url + "/stats")).json()
    return run, stats


async def _ttft(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    """Seconds to the first content delta of one streamed chat request."""
    t0 = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise NothingMeasured(f"{url}: HTTP {resp.status_code}")
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"]
                if delta and delta[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - t0
    if first is None:
        raise NothingMeasured(f"{url}: a stream without content")
    return first


async def overhead_pass(replica_url: str, router_url: str, router_pid: int | None, n: int,
                        prompt_words: int) -> dict[str, Any]:
    """Alternate direct and routed requests (order flipped each time); paired TTFT differences."""
    direct: list[float] = []
    routed: list[float] = []
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(3):  # connections and caches warm
            body = {"messages": [{"role": "user", "content": f"warm {i}"}], "max_tokens": 2, "stream": True}
            await _ttft(client, replica_url, body)
            await _ttft(client, router_url, body)
        await client.post(router_url + "/stats/reset")
        cpu0 = process_cpu_s(router_pid) if router_pid else None
        for i in range(n):
            text = f"question {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(prompt_words))
            body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
                    "max_tokens": 2, "stream": True}
            pair = [(direct, replica_url), (routed, router_url)]
            for out, url in pair if i % 2 == 0 else reversed(pair):
                out.append(await _ttft(client, url, body))
        cpu1 = process_cpu_s(router_pid) if router_pid else None
        stats = (await client.get(router_url + "/stats")).json()
    if not direct or not routed:
        raise NothingMeasured("the overhead pass measured nothing")
    added = [r - d for r, d in zip(routed, direct)]
    return {
        "requests": n, "prompt_words": prompt_words,
        "ttft_direct_ms": _stat(direct),
        "ttft_routed_ms": _stat(routed), "added_ttft_ms": _stat(added),
        "router_cpu_ms_per_request": None if cpu0 is None or cpu1 is None else 1e3 * (cpu1 - cpu0) / n,
        "decision_ms": stats["overhead"]["decision_ms"], "tokenize_ms": stats["overhead"]["tokenize_ms"],
        "decisions": stats["overhead"]["decisions"],
    }


def _stat(seconds: list[float]) -> dict[str, float]:
    s = Stat.of(seconds)
    return {"mean": s.mean, "p50": s.p50, "p90": s.p90, "p99": s.p99}


def trial_json(run: RunResult, stats: dict[str, Any], concurrency: int) -> dict[str, Any]:
    s = run.summary
    return {
        "completed": s.completed, "total": len(run.records), "errors": s.errors,
        "prompt_tokens": s.input_tokens, "cached_tokens": s.cached_tokens, "prefix_hit_rate": hit_rate(run),
        "ttft_p50_ms": s.ttft.p50, "ttft_p90_ms": s.ttft.p90, "e2e_p50_ms": s.e2e.p50,
        "request_throughput": s.request_throughput, "output_throughput": s.output_throughput,
        "duration_s": s.duration_s, "decision_ms": stats["overhead"]["decision_ms"],
        "tokenize_ms": stats["overhead"]["tokenize_ms"], "retries": stats["retries"],
        "routed": sorted(r["routed"] for r in stats["replicas"]),
        "predicted_cached_blocks": stats["predicted_cached_blocks"], "concurrency": concurrency,
        "records": [r.to_json() for r in run.records],
    }


MEDIANS = ("completed", "total", "prompt_tokens", "cached_tokens", "prefix_hit_rate", "ttft_p50_ms", "ttft_p90_ms",
          "e2e_p50_ms", "request_throughput", "output_throughput", "duration_s")


def median_of(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the trials (the trials themselves are kept alongside)."""
    out: dict[str, Any] = {k: statistics.median(t[k] for t in trials) for k in MEDIANS}
    for k in ("decision_ms", "tokenize_ms"):
        out[k] = {q: statistics.median(t[k][q] for t in trials) for q in trials[0][k]}
    out["completed"], out["total"] = min(t["completed"] for t in trials), trials[0]["total"]
    out["routed"] = [t["routed"] for t in trials]
    out["errors"] = [t["errors"] for t in trials]
    out["trials"] = trials
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# trillm bench router: {doc['replicas']} mock replicas, median of {doc['flags']['trials']} trials", ""]
    for wl, runs in doc["workloads"].items():
        lines += [f"## {wl}", "",
                  "| policy | ok/total | prefix hit rate | cached tokens | TTFT p50 | TTFT p90 | req/s | out tok/s "
                  "| decision p50 | decision p90 | requests per replica |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for policy, r in runs.items():
            lines.append(
                f"| {policy} | {r['completed']}/{r['total']} | {r['prefix_hit_rate']:.3f} | {r['cached_tokens']} "
                f"| {r['ttft_p50_ms']:.1f} ms | {r['ttft_p90_ms']:.1f} ms | {r['request_throughput']:.2f} "
                f"| {r['output_throughput']:.1f} | {r['decision_ms']['p50']:.2f} ms | {r['decision_ms']['p90']:.2f} ms "
                f"| {r['routed']} |")
        if "cached_ratio_kv_over_round_robin" in doc["comparisons"].get(wl, {}):
            c = doc["comparisons"][wl]
            lines += ["", f"kv / round-robin: {c['cached_ratio_kv_over_round_robin']:.2f}x cached tokens, "
                          f"TTFT p50 {c['ttft_p50_ratio_kv_over_round_robin']:.2f}x"]
        lines.append("")
    o = doc.get("overhead")
    if o:
        lines += ["## router overhead (one replica, one request at a time, direct vs routed)", "",
                  "| measure | p50 | p90 |", "|---|---|---|",
                  f"| TTFT direct | {o['ttft_direct_ms']['p50']:.2f} ms | {o['ttft_direct_ms']['p90']:.2f} ms |",
                  f"| TTFT through the router | {o['ttft_routed_ms']['p50']:.2f} ms | {o['ttft_routed_ms']['p90']:.2f} ms |",
                  f"| added TTFT (paired) | {o['added_ttft_ms']['p50']:.2f} ms | {o['added_ttft_ms']['p90']:.2f} ms |",
                  f"| router decision (read -> sent) | {o['decision_ms']['p50']:.2f} ms | {o['decision_ms']['p90']:.2f} ms |",
                  f"| of which tokenizing | {o['tokenize_ms']['p50']:.2f} ms | {o['tokenize_ms']['p90']:.2f} ms |"]
        if o["router_cpu_ms_per_request"] is not None:
            lines.append(f"\nrouter CPU per request: {o['router_cpu_ms_per_request']:.2f} ms")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trillm bench router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--policy", action="append", choices=POLICIES, default=None,
                   help="repeatable (default: kv and round-robin)")
    p.add_argument("--workload", action="append", choices=WORKLOADS, default=None, help="repeatable (default: both)")
    p.add_argument("--num-prompts", type=int, default=36,
                   help="requests per workload (multi-turn: conversations x turns; 9 conversations of 4 turns "
                        "by default, so sessions in lock-step cannot keep round-robin on one replica by luck)")
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128, help="words per user turn (shared-prefix: x4 question)")
    p.add_argument("--system-len", type=int, default=512, help="words of the system prompt")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=None, help="sessions in flight (default: all of them)")
    p.add_argument("--speedup", type=float, default=1.0, help="the mock replicas' --speedup")
    p.add_argument("--replica-flag", action="append", default=[], help="extra `serve --mock` flag (repeatable)")
    p.add_argument("--router-flag", action="append", default=[], help="extra `route` flag (repeatable)")
    p.add_argument("--trials", type=int, default=3, help="runs of each policy, in rotating order (medians reported)")
    p.add_argument("--overhead-requests", type=int, default=200, help="0 skips the overhead pass")
    p.add_argument("--overhead-words", type=int, default=400, help="prompt words in the overhead pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    policies = args.policy or ["kv", "round-robin"]
    workloads = args.workload or list(WORKLOADS)
    out = new_results_dir(args.results_dir)
    write_meta(out, "bench router", list(sys.argv[1:] if argv is None else argv), vars(args))
    spec = WorkloadSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                        num_turns=args.num_turns, system_len=args.system_len, seed=args.seed)
    opts = GenerationOptions(ignore_eos=True, timeout_s=300)
    replica_flags = ["--speedup", str(args.speedup), *args.replica_flag]
    doc: dict[str, Any] = {"replicas": args.replicas, "policies": policies, "workloads": {}, "comparisons": {},
                           "flags": {k: v for k, v in vars(args).items()}}
    try:
        for wl_name in workloads:
            workload = build(wl_name, spec)
            units = len(workload.sessions())
            concurrency = args.concurrency or units
            doc["workloads"][wl_name] = {}
            trials: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
            for t in range(args.trials):  # the order rotates, so the machine's drift hits every policy alike
                for policy in policies[t % len(policies):] + policies[:t % len(policies)]:
                    tag = f"{wl_name}-{policy}-t{t}"
                    fleet = Fleet.start(out, tag, args.replicas, policy, replica_flags, args.router_flag)
                    try:
                        run, stats = trio.run(drive, fleet.router.url, policy, workload, concurrency, opts,
                                              not args.no_progress)
                    finally:
                        fleet.stop()
                    check_measured(run, stats)
                    trials[policy].append(trial_json(run, stats, concurrency))
                    s = run.summary
                    print(f"{wl_name:>13} {policy:>12} trial {t}: {s.completed}/{len(run.records)} ok, hit rate "
                          f"{hit_rate(run):.3f}, TTFT p50 {s.ttft.p50:.0f} ms p90 {s.ttft.p90:.0f} ms, "
                          f"{s.output_throughput:.0f} out tok/s, decision p50 "
                          f"{stats['overhead']['decision_ms']['p50']:.2f} ms", file=sys.stderr, flush=True)
            runs = doc["workloads"][wl_name] = {policy: median_of(ts) for policy, ts in trials.items()}
            if "kv" in runs and "round-robin" in runs:
                kv, rr = runs["kv"], runs["round-robin"]
                doc["comparisons"][wl_name] = {
                    "cached_ratio_kv_over_round_robin": kv["cached_tokens"] / max(1, rr["cached_tokens"]),
                    "ttft_p50_ratio_kv_over_round_robin": kv["ttft_p50_ms"] / max(1e-9, rr["ttft_p50_ms"]),
                    "cached_ratio_per_trial": [a["cached_tokens"] / max(1, b["cached_tokens"])
                                               for a, b in zip(trials["kv"], trials["round-robin"])],
                    "same_requests_succeeded": all(x["completed"] == x["total"] for ts in trials.values() for x in ts),
                }
        if args.overhead_requests > 0:
            fleet = Fleet.start(out, "overhead", 1, "kv", ["--speedup", "1000", *args.replica_flag], args.router_flag)
            try:
                pid = fleet.router.proc.pid if fleet.router.proc is not None else None
                doc["overhead"] = trio.run(overhead_pass, fleet.replicas[0].url, fleet.router.url, pid,
                                           args.overhead_requests, args.overhead_words)
            finally:
                fleet.stop()
    except (NothingMeasured, ServerStartError) as exc:
        print(f"trillm bench router: {exc}", file=sys.stderr)
        write_json(out / "router.partial.json", doc)
        return 1
    write_json(out / "router.json", doc)
    text = markdown(doc)
    write_text_atomic(out / "router.md", text)
    print(text)
    c = doc["comparisons"].get("multi-turn")
    if c is not None:
        ok = c["cached_ratio_kv_over_round_robin"] >= 2.0
        print(f"multi-turn cached tokens, kv / round-robin: {c['cached_ratio_kv_over_round_robin']:.2f}x "
              f"(target >= 2x: {'met' if ok else 'MISSED'})")
    if "overhead" in doc:
        o = doc["overhead"]
        print(f"router overhead p50: decision {o['decision_ms']['p50']:.2f} ms, added TTFT {o['added_ttft_ms']['p50']:.2f} ms "
              f"(target < 2 ms)")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
