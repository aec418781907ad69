"""`trillm bench soak`: a long mixed load with random client disconnects against a live server.

Clients loop for --duration seconds, each request one of: an SSE stream, a plain (non-streaming) request, or a
websocket with one to three generations; n in {1, 2, 3}, half with stop strings, chat or completion. A
--disconnect fraction of them goes away mid-request (closes the stream, cancels the request, closes or
cancels on the socket). At the end, once the server has settled: nothing may be live, running or waiting and
no KV block held (GET /stats); the server's RSS growth after --warmup net of its KV pool's growth is the leak
figure (the pool grows with the load by design, engine/kv_slabs.py; both growths are reported), and the 5xx,
resets and the p50/p99 latency of the well-behaved clients (those that did not disconnect) are reported.

With --hostile N the run has two measured phases after a short warm-up: --duration seconds of
the well-behaved load alone, then the same load (same seed) for --duration more beside N hostile clients
(bench/harness/hostile.py: oversized bodies of every API, which must get 400s; completions fan-outs of prompts x n
up to the server's cap; special-token floods). It reports the well-behaved clients' p99 TTFT and ITL (gaps
between one choice's SSE chunks) in each phase and their ratio (target under --max-ratio, 1.5); a phase that
measured no TTFT or ITL fails the run (exit 2).

With no --url it starts `trillm serve` itself (the default model, --model PATH, or --mock) and samples that
process's RSS; with --url give --server-pid so its RSS can be sampled. A server the soak starts allocates its
whole KV pool at start (--kv-pool full: a --kv-slab-mb as large as the pool, which then neither grows nor
shrinks), so no phase pays for the pool's growth and the hostile ratio compares like with like; --kv-pool grow
keeps the server's default growing pool. Exit 1 when a target is missed (any 5xx, reset, error event, leaked
block or live request; RSS growth net of the pool's over --max-rss-growth-mb), 2 when it measured nothing.

    flock /tmp/trillm-bench.lock trillm bench soak --mock --duration 1800 --clients 96 --disconnect 0.3
    flock /tmp/trillm-bench.lock trillm bench soak --duration 120 --warmup 20 --clients 8 --hostile 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

from trillm.bench.harness.results import new_results_dir, write_json, write_meta
from trillm.bench.harness.servers import ServerProcess, blas_env, free_port
from trillm.bench.harness.hostile import HostileMix, HostileTally, hostile_clients, hostile_missed

STOP_STRINGS = (".", "\n", " the", " a", " ab", " zz", " q")
WORDS = ("the quick brown fox jumps over the lazy dog while a small model learns to count and write "
         "stories about cities rivers numbers and colours").split()


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)  # resets, closed without a response
    error_events: Counter[str] = field(default_factory=Counter)  # error events/messages (by code), no [DONE]
    ttft_s: list[float] = field(default_factory=list)  # well-behaved streams
    itl_s: list[float] = field(default_factory=list)  # well-behaved SSE streams: gaps between a choice's tokens
    e2e_s: list[float] = field(default_factory=list)  # well-behaved requests of every kind

    def transport(self, exc: BaseException) -> None:
        self.transport_errors[type(exc).__name__] += 1


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


FULL_POOL_SLAB_MB = 1 << 20  # --kv-pool full: one slab larger than any pool (capped at the pool's size)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Workload:
    def __init__(self, args: argparse.Namespace) -> None:
        self.rng = random.Random(args.seed)
        self.max_tokens = args.max_tokens
        self.disconnect = args.disconnect
        self.ids = 0

    def body(self) -> dict[str, Any]:
        rng = self.rng
        self.ids += 1
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
        body: dict[str, Any] = {"max_tokens": rng.choice(self.max_tokens), "n": rng.choice((1, 1, 2, 3)),
                                "temperature": rng.choice((0.0, 0.7)), "seed": self.ids}
        if rng.random() < 0.5:
            body["stop"] = rng.sample(STOP_STRINGS, 2)
        if rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body


def path_of(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _texts(chunk: dict[str, Any]) -> list[int]:
    """The choice indices of a chunk's choices that carry text (a chat role chunk or usage chunk has none)."""
    return [c.get("index", 0) for c in chunk.get("choices") or ()
            if c.get("text") or (c.get("delta") or {}).get("content")]


async def sse(client: httpx.AsyncClient, body: dict[str, Any], cut: int | None, tally: Tally) -> None:
    t0 = time.perf_counter()
    first: float | None = None  # the first chunk with text: the chat role chunk is no token
    last: dict[int, float] = {}  # per choice, when its latest text arrived
    gaps: list[float] = []
    async with client.stream("POST", path_of(body), json={**body, "stream": True}) as r:
        tally.statuses[r.status_code] += 1
        if r.status_code != 200:
            await r.aread()
            return
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                tally.completed += 1
                if cut is None and first is not None:
                    tally.ttft_s.append(first - t0)
                    tally.itl_s.extend(gaps)
                    tally.e2e_s.append(time.perf_counter() - t0)
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                tally.error_events[chunk["error"].get("code") or "?"] += 1
            now = time.perf_counter()
            for i in _texts(chunk):
                if first is None:
                    first = now
                if i in last:
                    gaps.append(now - last[i])
                last[i] = now
            events += 1
            if cut is not None and events >= cut:
                tally.disconnects += 1
                return  # leaving the block closes the connection mid-stream
    tally.error_events["no-done"] += 1


async def plain(client: httpx.AsyncClient, body: dict[str, Any], cut_s: float | None, tally: Tally) -> None:
    t0 = time.perf_counter()
    with trio.move_on_after(cut_s if cut_s is not None else 3600) as scope:
        r = await client.post(path_of(body), json=body)
        tally.statuses[r.status_code] += 1
        if r.status_code == 200:
            tally.completed += 1
            tally.e2e_s.append(time.perf_counter() - t0)
    if scope.cancelled_caught:
        tally.disconnects += 1


async def websocket(url: str, work: Workload, tally: Tally) -> None:
    rng = work.rng
    t0 = time.perf_counter()
    async with trio_websocket.open_websocket_url(url.replace("http", "ws", 1) + "/v1/ws",
                                                 disconnect_timeout=10) as ws:
        gids = [str(work.ids * 10 + k) for k in range(rng.randint(1, 3))]
        for gid in gids:
            await ws.send_message(json.dumps({"type": "generate", "id": gid, **work.body()}))
        cut = rng.random() < work.disconnect
        pending, first = set(gids), None
        cancelled: set[str] = set()
        while pending:
            msg = json.loads(await ws.get_message())
            if msg["type"] == "delta":
                first = first or time.perf_counter()
                if cut:
                    if rng.random() < 0.5:
                        # It may finish before the cancel arrives: the cancel then gets a "no running generation".
                        cancelled.add(msg["id"])
                        await ws.send_message(json.dumps({"type": "cancel", "id": msg["id"]}))
                        cut = False
                    else:
                        tally.disconnects += 1
                        return  # closes the socket with its generations running
            elif msg["type"] == "done":
                pending.discard(msg["id"])
                tally.completed += 1
            elif msg["type"] == "cancelled":
                pending.discard(msg["id"])
                tally.disconnects += 1
            elif msg["type"] == "error":
                if msg["id"] in cancelled and msg["error"].get("code") == "generation_not_found":
                    continue
                pending.discard(msg["id"])
                tally.error_events[msg["error"].get("code") or "?"] += 1
        if first is not None and not cut:
            tally.ttft_s.append(first - t0)
            tally.e2e_s.append(time.perf_counter() - t0)


async def load(url: str, args: argparse.Namespace, tally: Tally, deadline: float) -> None:
    work = Workload(args)
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        async def worker() -> None:
            rng = work.rng
            while trio.current_time() < deadline:
                kind = rng.random()
                cut = rng.random() < args.disconnect
                tally.requests += 1
                try:
                    if kind < 0.45:
                        tally.by_kind["sse"] += 1
                        await sse(client, work.body(), rng.randint(1, 8) if cut else None, tally)
                    elif kind < 0.8:
                        tally.by_kind["plain"] += 1
                        await plain(client, work.body(), rng.uniform(0.005, 0.5) if cut else None, tally)
                    else:
                        tally.by_kind["websocket"] += 1
                        await websocket(url, work, tally)
                except (httpx.TransportError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed,
                        OSError) as exc:
                    tally.transport(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(args.clients):
                nursery.start_soon(worker)


async def settle(client: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
    """GET /stats until nothing is live, running or waiting and no block is held (or timeout_s passed)."""
    deadline = trio.current_time() + timeout_s
    while True:
        model: dict[str, Any] = (await client.get("/stats")).json()["models"][0]
        engine = model["engine"] or {}
        idle = model["live_requests"] == 0 and not engine.get("running") and not engine.get("waiting") \
            and not engine.get("kv_blocks_used")
        if idle or trio.current_time() > deadline:
            return model
        await trio.sleep(0.2)


def merge(into: Tally, part: Tally) -> None:
    into.requests += part.requests
    into.completed += part.completed
    into.disconnects += part.disconnects
    for name in ("by_kind", "statuses", "transport_errors", "error_events"):
        getattr(into, name).update(getattr(part, name))
    for name in ("ttft_s", "itl_s", "e2e_s"):
        getattr(into, name).extend(getattr(part, name))


def well_behaved(tally: Tally) -> dict[str, Any]:
    return {"n": len(tally.e2e_s), "ttft_p50_s": percentile(tally.ttft_s, 0.5),
            "ttft_p99_s": percentile(tally.ttft_s, 0.99), "itl_p50_s": percentile(tally.itl_s, 0.5),
            "itl_p99_s": percentile(tally.itl_s, 0.99), "itl_gaps": len(tally.itl_s),
            "e2e_p50_s": percentile(tally.e2e_s, 0.5), "e2e_p99_s": percentile(tally.e2e_s, 0.99)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


async def phases(url: str, control: httpx.AsyncClient, args: argparse.Namespace, tally: Tally,
                 current: list[Tally]) -> dict[str, Any]:
    """--hostile: a warm-up (unmeasured), then the same well-behaved load alone and beside the hostile mix
    (the same seed: the same sequence of requests), each --duration seconds, settling between them."""
    model = (await control.get("/v1/models")).json()["data"][0]["id"]
    mix = HostileMix(model, int(args.oversized_mb * (1 << 20)), args.fanout_prompts, args.fanout_n,
                     args.fanout_max_tokens, args.flood_max_tokens, args.flood_n)
    hostile = HostileTally()
    report: dict[str, Any] = {}
    for name, seconds in (("warmup", args.phase_warmup), ("baseline", args.duration), ("hostile", args.duration)):
        if seconds <= 0:
            continue
        part = current[0] = Tally()
        start = trio.current_time()
        print(f"soak: phase {name}, {seconds:.0f} s", flush=True)
        async with trio.open_nursery() as nursery:
            if name == "hostile":
                nursery.start_soon(hostile_clients, url, mix, args.hostile, hostile, start + seconds, args.seed)
            nursery.start_soon(load, url, args, part, start + seconds)
        merge(tally, part)
        report[name] = {"seconds": trio.current_time() - start, "requests": part.requests,
                        "statuses": dict(part.statuses), "well_behaved": well_behaved(part)}
        await settle(control, args.settle_s)
    base, host = report["baseline"]["well_behaved"], report["hostile"]["well_behaved"]
    return {"clients": args.hostile, "mix": {k: v for k, v in vars(mix).items() if k != "model"},
            "phases": report, "hostile_requests": hostile.summary(),
            "ratio": {"ttft_p99": ratio(host["ttft_p99_s"], base["ttft_p99_s"]),
                      "itl_p99": ratio(host["itl_p99_s"], base["itl_p99_s"])}}


async def run(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    current = [tally]  # what the progress line counts: the running phase's tally under --hostile
    mixed: dict[str, Any] | None = None
    samples: list[tuple[float, float, float]] = []  # (seconds since start, RSS MB, KV pool MB)
    occupancy: list[tuple[int, int]] = []  # (running, waiting) once a second: how full the batch was
    t0 = trio.current_time()

    async def sampler() -> None:
        while True:
            engine = (await control.get("/stats")).json()["models"][0]["engine"] or {}
            if (mb := rss_mb(pid)) is not None:
                samples.append((trio.current_time() - t0, mb, engine.get("kv_pool_bytes", 0) / 2**20))
            occupancy.append((engine.get("running", 0), engine.get("waiting", 0)))
            await trio.sleep(1.0)

    async with httpx.AsyncClient(base_url=url, timeout=30) as control:
        before = (await control.get("/stats")).json()["models"][0]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            nursery.start_soon(progress, current, t0, args.duration * (2 if args.hostile else 1))
            if args.hostile:
                mixed = await phases(url, control, args, tally, current)
            else:
                await load(url, args, tally, t0 + args.duration)
            elapsed = trio.current_time() - t0
            model = await settle(control, args.settle_s)
            await trio.sleep(1.1)  # one more RSS sample, settled
            nursery.cancel_scope.cancel()
    engine = model["engine"] or {}
    fivexx = sum(n for code, n in tally.statuses.items() if code >= 500)
    return {
        "url": url, "kv_pool": args.kv_pool, "duration_s": elapsed, "clients": args.clients,
        "disconnect_fraction": args.disconnect,
        "requests": tally.requests, "completed": tally.completed, "disconnects": tally.disconnects,
        "by_kind": dict(tally.by_kind), "statuses": dict(tally.statuses), "5xx": fivexx,
        "transport_errors": dict(tally.transport_errors), "error_events": dict(tally.error_events),
        "requests_per_s": tally.requests / elapsed if elapsed else 0.0,
        "engine_load": {"running_mean": sum(r for r, _ in occupancy) / len(occupancy) if occupancy else None,
                        "running_max": max((r for r, _ in occupancy), default=None),
                        "waiting_max": max((w for _, w in occupancy), default=None)},
        "well_behaved": well_behaved(tally),
        **({"hostile": mixed} if mixed is not None else {}),
        "after": {"live_requests": model["live_requests"], "running": engine.get("running"),
                  "waiting": engine.get("waiting"), "kv_blocks_used": engine.get("kv_blocks_used"),
                  "restarts": model["restarts"] - before["restarts"], "outcomes": model["requests"]},
        **memory_figures(samples, args.warmup),
    }


def growth(samples: list[tuple[float, float]], warmup: float) -> dict[str, Any]:
    """One series of (seconds, MB) samples: where it started, stood after the warm-up, peaked and ended."""
    warm = [mb for t, mb in samples if t >= warmup]
    after_warmup = warm[0] if warm else None
    final = samples[-1][1] if samples else None
    return {"start": samples[0][1] if samples else None, "after_warmup": after_warmup,
            "max": max((mb for _, mb in samples), default=None), "final": final,
            "growth_after_warmup": None if final is None or after_warmup is None else final - after_warmup}


def memory_figures(samples: list[tuple[float, float, float]], warmup: float) -> dict[str, Any]:
    """The server's RSS and its KV pool's allocation after the warm-up, and the leak figure: RSS growth net of
    the pool's, since the pool grows with the load (and shrinks when idle) by design; what else grows may leak."""
    rss = growth([(t, mb) for t, mb, _ in samples], warmup)
    pool = growth([(t, mb) for t, _, mb in samples], warmup)
    leak = None if rss["growth_after_warmup"] is None else rss["growth_after_warmup"] - pool["growth_after_warmup"]
    return {"rss_mb": {**rss, "samples": len(samples), "trend": trend(samples, 10)}, "kv_pool_mb": pool,
            "leak_mb": leak}


def trend(samples: list[tuple[float, float, float]], points: int) -> list[tuple[int, float, float]]:
    """RSS and the KV pool at `points` evenly spaced moments, (seconds, RSS MB, pool MB): is RSS still
    growing at the end, or flat, and how much of it is the pool?"""
    if not samples:
        return []
    step = max(1, len(samples) // points)
    picked = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    return [(round(t), round(mb, 1), round(pool, 1)) for t, mb, pool in picked]


async def progress(current: list[Tally], t0: float, duration: float) -> None:
    while True:
        await trio.sleep(60)
        tally = current[0]
        print(f"  {trio.current_time() - t0:5.0f}/{duration:.0f} s: {tally.requests} requests, {tally.completed} "
              f"completed, {tally.disconnects} disconnects, statuses {dict(tally.statuses)}", flush=True)


def measured_nothing(res: dict[str, Any]) -> str | None:
    """Why this run cannot stand for anything (None: it measured something)."""
    if not res["completed"]:
        return "no request completed"
    if not res["well_behaved"]["n"]:
        return "no well-behaved request completed"
    if res["leak_mb"] is None:
        return "no RSS sample after the warm-up"
    if "hostile" in res:
        for name in ("baseline", "hostile"):
            wb = res["hostile"]["phases"][name]["well_behaved"]
            if wb["ttft_p99_s"] is None or wb["itl_p99_s"] is None:
                return f"the {name} phase measured no well-behaved stream's TTFT and ITL"
        unanswered = [k for k, codes in res["hostile"]["hostile_requests"]["statuses"].items() if not codes]
        if unanswered:
            return f"the hostile phase got no response to its {', '.join(unanswered)} requests"
    return None


def verdict(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The targets this run missed (empty: all met)."""
    missed = []
    after, leak = res["after"], res["leak_mb"]
    if res["5xx"]:
        missed.append(f"{res['5xx']} responses were 5xx")
    if res["transport_errors"]:
        missed.append(f"connection errors: {res['transport_errors']}")
    if res["error_events"]:
        missed.append(f"streams ended with an error or without [DONE]: {res['error_events']}")
    if after["live_requests"] or after["running"] or after["waiting"]:
        missed.append(f"still live after settling: {after}")
    if after["kv_blocks_used"]:
        missed.append(f"{after['kv_blocks_used']} KV blocks still held")
    if after["restarts"]:
        missed.append(f"the engine restarted {after['restarts']} times")
    if leak is not None and leak > args.max_rss_growth_mb:
        missed.append(f"RSS grew {leak:.1f} MB after warm-up net of the KV pool's growth "
                      f"(> {args.max_rss_growth_mb})")
    if "hostile" in res:
        mixed = res["hostile"]
        missed += hostile_missed(mixed["hostile_requests"])
        if mixed["hostile_requests"]["transport_errors"]:
            missed.append(f"hostile connection errors: {mixed['hostile_requests']['transport_errors']}")
        for what, r in mixed["ratio"].items():
            if r is not None and r > args.max_ratio:
                missed.append(f"well-behaved p99 {what.split('_')[0].upper()} with the hostile mix is {r:.2f}x "
                              f"without it (> {args.max_ratio})")
    return missed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trillm bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", default=None, help="a running server (give --server-pid to sample its RSS)")
    target.add_argument("--mock", action="store_true", help="start `trillm serve --mock`")
    target.add_argument("--model", default=None, help="start `trillm serve --model MODEL` (default: the default model)")
    p.add_argument("--server-pid", type=int, default=None)
    p.add_argument("--serve-arg", action="append", default=[], help="one more flag for the started server")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=120.0, help="RSS growth is measured from this many seconds in")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (each loops request after request)")
    p.add_argument("--disconnect", type=float, default=0.3, help="fraction of requests that disconnect mid-way")
    p.add_argument("--max-tokens", default="8,32,128", help="max_tokens choices (comma-separated)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--settle-s", type=float, default=30.0, help="wait this long at most for the server to idle")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0,
                   help="target: RSS growth after --warmup net of the KV pool's growth")
    p.add_argument("--kv-pool", choices=("full", "grow"), default=None,
                   help="the started server's KV pool: full (default) allocated whole at start, so no phase pays "
                        "for its growth; grow: the server's default, growing with the load")
    p.add_argument("--seed", type=int, default=0)
    h = p.add_argument_group("hostile mix", "with --hostile N: a warm-up, then --duration seconds of the "
                             "well-behaved load alone and --duration more beside N hostile clients")
    h.add_argument("--hostile", type=int, default=0, help="hostile clients (0: no hostile mix, one phase)")
    h.add_argument("--phase-warmup", type=float, default=10.0, help="unmeasured seconds before the two phases")
    h.add_argument("--max-ratio", type=float, default=1.5,
                   help="target: well-behaved p99 TTFT and ITL with the hostile mix / without it")
    h.add_argument("--oversized-mb", type=float, default=2.0,
                   help="oversized bodies' bulk (over --max-prompt-bytes, under --max-request-bytes)")
    h.add_argument("--fanout-prompts", type=int, default=64, help="prompts in one fan-out completions batch")
    h.add_argument("--fanout-n", type=int, default=4, help="n of a fan-out (prompts x n: the server's cap, 256)")
    h.add_argument("--fanout-max-tokens", type=int, default=128)
    h.add_argument("--flood-max-tokens", type=int, default=2000, help="a special-token flood's max_tokens")
    h.add_argument("--flood-n", type=int, default=4)
    p.add_argument("--results-dir", default="results")
    args = p.parse_args(argv)
    args.max_tokens = [int(x) for x in args.max_tokens.split(",")]
    if not 0 <= args.disconnect <= 1 or args.clients < 1 or args.duration <= 0 or args.hostile < 0:
        p.error("--disconnect must be in [0, 1], --clients >= 1, --duration > 0 and --hostile >= 0")
    if args.hostile == 1:
        p.error("--hostile needs at least 2 clients (a fan-out and a flood run side by side)")
    if args.url is not None and args.server_pid is None:
        p.error("--url needs --server-pid (the soak measures the server's RSS)")
    if args.url is not None and args.kv_pool is not None:
        p.error("--kv-pool sets up a server the soak starts; a --url server's pool is its own")
    if args.url is None and args.kv_pool is None:
        args.kv_pool = "full"

    out = new_results_dir(args.results_dir)
    write_meta(out, "bench soak", sys.argv, vars(args))
    server: ServerProcess | None = None
    if args.url is None:
        port = free_port()
        # Before --serve-arg: a --kv-slab-mb given there wins.
        pool = ["--kv-slab-mb", str(FULL_POOL_SLAB_MB)] if args.kv_pool == "full" else []
        command = [sys.executable, "-m", "trillm.web.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "warning", *(["--mock"] if args.mock else []),
                   *(["--model", args.model] if args.model else []), *pool, *args.serve_arg]
        server = ServerProcess("trillm", command, port, out / "server.log", env=blas_env())
        server.start()
        server.wait_ready()
        assert server.proc is not None
        url, pid = server.url, server.proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.server_pid
    try:
        print(f"soak: {args.clients} clients for {args.duration:.0f} s against {url}, {args.disconnect:.0%} "
              f"disconnect; results in {out}", flush=True)
        res = trio.run(run, url, pid, args)
    finally:
        if server is not None:
            server.stop()
    write_json(out / "soak.json", res)
    print(json.dumps({k: v for k, v in res.items()}, indent=1))
    if (why := measured_nothing(res)) is not None:
        print(f"soak: measured nothing ({why}); failing", file=sys.stderr)
        return 2
    if "hostile" in res:
        ph, r = res["hostile"]["phases"], res["hostile"]["ratio"]
        print("soak: well-behaved p99 TTFT {:.3f} s -> {:.3f} s ({:.2f}x), p99 ITL {:.3f} s -> {:.3f} s ({:.2f}x) "
              "without -> with the hostile mix".format(
                  ph["baseline"]["well_behaved"]["ttft_p99_s"] or 0, ph["hostile"]["well_behaved"]["ttft_p99_s"] or 0,
                  r["ttft_p99"] or 0, ph["baseline"]["well_behaved"]["itl_p99_s"] or 0,
                  ph["hostile"]["well_behaved"]["itl_p99_s"] or 0, r["itl_p99"] or 0))
    rss, kv = res["rss_mb"], res["kv_pool_mb"]
    print(f"soak: after warm-up RSS {rss['after_warmup']:.1f} -> {rss['final']:.1f} MB "
          f"({rss['growth_after_warmup']:+.1f}), KV pool {kv['after_warmup']:.1f} -> {kv['final']:.1f} MB "
          f"({kv['growth_after_warmup']:+.1f}); leak figure (RSS net of the pool) {res['leak_mb']:+.1f} MB")
    missed = verdict(res, args)
    for line in missed:
        print(f"soak: target missed: {line}", file=sys.stderr)
    print("soak: all targets met" if not missed else f"soak: {len(missed)} targets missed")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
