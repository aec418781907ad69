"""`trillm simulate TRACE`: replay a request trace against the mock engine in virtual time.

The trace's requests go through the same inline EngineService (and so the same GenerationHandles, scheduler
and block manager) as `trillm serve --mock`, but on `trio.testing.MockClock(autojump_threshold=0)`: time
jumps whenever every task waits, so an hour of traffic takes seconds. Each simulated client records what
`trillm bench serve` records (TTFT, ITL, TPOT, E2E, usage) against the virtual clock, and the run is written
with the same report code: serve.json / serve.md / plots under RESULTS_DIR/<timestamp>/.

With `--replicas N` the trace goes through the router's own decision core (trillm.web.router.core, the
same Router and policy `trillm route` runs) to N inline services, each fed its replica's KV events and
load the way `trillm route` is fed over /internal/kv-events: capacity planning for a routed fleet.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import trio.testing

from trillm.bench.harness.metrics import RequestRecord
from trillm.engine.config import add_engine_arguments, engine_config_from_args
from trillm.engine.errors import EngineError
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.mock import (
    MockModelSpec, TraceRequest, add_mock_arguments, load_trace, mock_engine_factory, multi_turn_trace, prompt_tokens,
    save_trace, synthetic_trace,
)
from trillm.engine.outputs import EngineStatistics
from trillm.engine.sampling_params import SamplingParams
from trillm.web.service.engine_service import EngineService
from trillm.web.router.core import Hello, Router, WorkerKey
from trillm.web.router.policy import CostWeights, Policy
from trillm.web.service.stream import GenerationFailed, GenerationHandle

HELP = "replay a request trace on the mock engine in virtual time"


@dataclass(slots=True)
class SimulationResult:
    records: list[RequestRecord]
    virtual_s: float  # simulated time from the first arrival to the last completion
    wall_s: float
    num_steps: int
    num_idle_steps: int
    final_stats: EngineStatistics | None  # the engine's statistics after the run
    live_after: int  # requests the service still tracks after the run (should be 0)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Submitted:
    handle: GenerationHandle
    on_first_token: Callable[[], None] | None = None  # the router's bookkeeping, when one routed it


Submit = Callable[[list[int], SamplingParams], AbstractContextManager[Submitted]]


def direct(service: EngineService) -> Submit:
    @contextmanager
    def submit(prompt: list[int], params: SamplingParams) -> Iterator[Submitted]:
        with service.submit(prompt, params) as handle:
            yield Submitted(handle)

    return submit


async def _client(submit: Submit, req: TraceRequest, index: int, prompt: list[int], t0: float,
                  records: list[RequestRecord]) -> None:
    start = trio.current_time()
    chunks: list[float] = []
    usage = None
    chars = 0
    error: tuple[str, str] | None = None
    try:
        with submit(prompt, SamplingParams(max_tokens=req.output_length, ignore_eos=True)) as submitted:
            while True:
                try:
                    out = await submitted.handle.receive()
                except trio.EndOfChannel:
                    break
                if out.new_token_ids:
                    if not chunks and submitted.on_first_token is not None:
                        submitted.on_first_token()
                    chunks.append(trio.current_time() - start)
                chars += len(out.new_text)
                usage = out.usage
    except (EngineError, GenerationFailed) as exc:
        error = (type(exc).__name__, str(exc))
    records.append(RequestRecord(
        request_id=f"trace-{index}", start=start - t0, latency=trio.current_time() - start,
        chunk_times=tuple(chunks), prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        cached_tokens=usage.cached_tokens if usage else None, num_chars=chars,
        error_kind=error[0] if error else None, error=error[1] if error else None,
    ))


async def simulate_async(trace: list[TraceRequest], service: EngineService, *, vocab_size: int,
                         block_tokens: int = 512, seed: int = 0) -> SimulationResult:
    """Replay `trace` on the current trio clock against `service` (not running yet): the inline mock for a
    simulation, or the threaded real engine in real time for a parity run."""
    records: list[RequestRecord] = []
    wall0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        t0 = trio.current_time()
        async with trio.open_nursery() as clients:
            for i, req in enumerate(trace):
                await trio.sleep_until(t0 + req.timestamp / 1000)
                prompt = prompt_tokens(req, i, vocab_size=vocab_size, block_tokens=block_tokens, seed=seed)
                clients.start_soon(_client, direct(service), req, i, prompt, t0, records)
        virtual = trio.current_time() - t0
        while (st := service.statistics()).num_live_requests or (
                st.engine is not None and (st.engine.num_running or st.engine.num_waiting)):
            await trio.sleep(0.001)  # settle: the step that delivered the last token reports the engine idle
        nursery.cancel_scope.cancel()
    records.sort(key=lambda r: r.start)
    return SimulationResult(records, virtual, time.perf_counter() - wall0, st.num_steps, st.num_idle_steps,
                            st.engine, st.num_live_requests)


def simulate(trace: list[TraceRequest], engine_factory: Callable[[], LLMEngine], *, vocab_size: int,
             block_tokens: int = 512, seed: int = 0) -> SimulationResult:
    """Run `trace` through an inline EngineService around `engine_factory`'s mock engine on a virtual clock
    (trio.testing.MockClock with autojump_threshold=0)."""
    service = EngineService(engine_factory, inline=True)
    return trio.run(
        lambda: simulate_async(trace, service, block_tokens=block_tokens, vocab_size=vocab_size, seed=seed),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )


@dataclass(slots=True)
class RoutedSimulation:
    result: SimulationResult  # final_stats: the first replica's; see per_replica for all
    policy: str
    routed: dict[str, int]  # replica -> requests routed there
    per_replica: dict[str, EngineStatistics | None]
    num_resyncs: int


async def _feed(router: Router, key: WorkerKey, service: EngineService, interval_s: float) -> None:
    """What /internal/kv-events and the router's subscriber do, without the websocket: every interval, the
    service's new step reports go into the router; a broken stream restarts with a fresh hello."""
    while True:
        await trio.sleep(interval_s)
        reports = service.drain_reports()
        st = service.statistics()
        if reports and not router.on_steps(key, st.epoch, reports):
            router.on_hello(key, Hello(st.epoch, service.kv_cache_spec, interval_s))


async def simulate_router_async(trace: list[TraceRequest], services: list[EngineService], router: Router, *,
                                vocab_size: int, block_tokens: int = 512, seed: int = 0,
                                interval_s: float = 0.05) -> RoutedSimulation:
    """Replay `trace` through `router` (its replicas named by index) over `services` (not running yet)."""
    urls = list(router.replicas)
    if len(urls) != len(services):
        raise ValueError("one service per router replica")
    records: list[RequestRecord] = []
    wall0 = time.perf_counter()
    by_url = dict(zip(urls, services))
    async with trio.open_nursery() as nursery:
        for url, service in by_url.items():
            await nursery.start(service.run)
            router.on_health(url, True, trio.current_time())
            (key,), _ = router.set_models(url, [service.model_name])
            router.on_hello(key, Hello(service.statistics().epoch, service.kv_cache_spec, interval_s))
            nursery.start_soon(_feed, router, key, service, interval_s)

        @contextmanager
        def submit(prompt: list[int], params: SamplingParams) -> Iterator[Submitted]:
            a = router.choose(None, prompt)
            if a is None:
                raise EngineError("no replica in the pool")
            computed = False
            try:  # the router forgets the request when its response ends, as the proxy does
                with by_url[a.worker.replica].submit(prompt, params) as handle:
                    yield Submitted(handle, lambda: router.on_first_token(a))
                computed = True
            finally:
                router.release(a, computed=computed)

        t0 = trio.current_time()
        async with trio.open_nursery() as clients:
            for i, req in enumerate(trace):
                await trio.sleep_until(t0 + req.timestamp / 1000)
                prompt = prompt_tokens(req, i, vocab_size=vocab_size, block_tokens=block_tokens, seed=seed)
                clients.start_soon(_client, submit, req, i, prompt, t0, records)
        virtual = trio.current_time() - t0
        for service in services:
            while (st := service.statistics()).num_live_requests or (
                    st.engine is not None and (st.engine.num_running or st.engine.num_waiting)):
                await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    records.sort(key=lambda r: r.start)
    stats = [s.statistics() for s in services]
    rs = router.statistics()
    result = SimulationResult(records, virtual, time.perf_counter() - wall0, sum(s.num_steps for s in stats),
                              sum(s.num_idle_steps for s in stats), stats[0].engine,
                              sum(s.num_live_requests for s in stats))
    return RoutedSimulation(result, rs.policy, {r.url: r.num_routed for r in rs.replicas},
                            {url: st.engine for url, st in zip(urls, stats)},
                            sum(w.index.num_resyncs for r in rs.replicas for w in r.workers))


def simulate_router(trace: list[TraceRequest], engine_factory: Callable[[], LLMEngine], *, num_replicas: int,
                    policy: str = "kv", weights: CostWeights = CostWeights(), vocab_size: int,
                    block_tokens: int = 512, seed: int = 0) -> RoutedSimulation:
    """`trace` through the router's core over `num_replicas` inline mock services, on a virtual clock."""
    if num_replicas < 1:
        raise ValueError("num_replicas must be >= 1")
    router = Router([f"sim://replica-{i}" for i in range(num_replicas)], Policy(policy, weights))
    services = [EngineService(engine_factory, inline=True) for _ in range(num_replicas)]
    return trio.run(
        lambda: simulate_router_async(trace, services, router, vocab_size=vocab_size, block_tokens=block_tokens,
                                      seed=seed),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("trace", nargs="?", help="JSONL trace (mooncake style); see --synthetic")
    p.add_argument("--synthetic", action="store_true",
                   help="generate the trace instead (see --rate, --duration, ...); with TRACE, also write it there")
    p.add_argument("--rate", type=float, default=2.0, help="synthetic: requests/s")
    p.add_argument("--duration", type=float, default=60.0, help="synthetic: seconds of traffic")
    p.add_argument("--input-len", type=int, default=512, help="synthetic")
    p.add_argument("--output-len", type=int, default=128, help="synthetic")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--conversations", type=int, default=None, metavar="N",
                   help="synthetic: N multi-turn chats instead (each turn --input-len more tokens)")
    p.add_argument("--turns", type=int, default=4, help="synthetic multi-turn: turns per chat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--name", default="mock-sim", help="server label in the report")
    g = p.add_argument_group("routing (capacity planning)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="route the trace over N replicas with trillm route's decision core")
    g.add_argument("--policy", choices=("kv", "round-robin", "least-loaded"), default="kv")
    g.add_argument("--prefill-weight", type=float, default=CostWeights().prefill_weight)
    g.add_argument("--request-weight", type=float, default=CostWeights().request_weight)
    add_engine_arguments(p)
    add_mock_arguments(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trillm simulate")
    configure(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`trillm simulate`: write serve.json / serve.md (as `trillm bench serve`) plus sim.json."""
    from trillm.bench.harness import report
    from trillm.bench.harness.arrival import Arrival
    from trillm.bench.harness.client import Target
    from trillm.bench.harness.metrics import summarize
    from trillm.bench.harness.results import new_results_dir, write_meta
    from trillm.bench.harness.run import RunResult

    if args.synthetic and args.conversations:
        trace = multi_turn_trace(num_conversations=args.conversations, num_turns=args.turns,
                                 turn_tokens=args.input_len, output_len=args.output_len,
                                 block_tokens=args.block_tokens, seed=args.seed)
        if args.trace:
            save_trace(args.trace, trace)
        name = f"multi-turn-{args.conversations}x{args.turns}"
    elif args.synthetic:
        trace = synthetic_trace(duration_s=args.duration, rate=args.rate, input_len=args.input_len,
                                output_len=args.output_len, block_tokens=args.block_tokens, seed=args.seed)
        if args.trace:
            save_trace(args.trace, trace)
        name = f"synthetic-r{args.rate:g}-{args.duration:g}s"
    elif args.trace:
        trace = load_trace(args.trace)
        name = Path(args.trace).stem
    else:
        print("trillm simulate: give a TRACE file or --synthetic", file=sys.stderr)
        return 2
    if not trace:
        print("trillm simulate: the trace is empty", file=sys.stderr)
        return 2
    spec = MockModelSpec()
    factory = mock_engine_factory(args, engine_config_from_args(args), spec=spec)
    out = new_results_dir(args.results_dir)
    write_meta(out, "simulate", sys.argv[1:], {k: v for k, v in vars(args).items() if k != "run"})
    routed = None
    if args.replicas is not None:
        routed = simulate_router(trace, factory, num_replicas=args.replicas, policy=args.policy,
                                 weights=CostWeights(args.prefill_weight, 1.0, args.request_weight),
                                 vocab_size=spec.vocab_size, block_tokens=args.block_tokens, seed=args.seed)
        res = routed.result
    else:
        res = simulate(trace, factory, vocab_size=spec.vocab_size, block_tokens=args.block_tokens, seed=args.seed)
    if not res.records or res.final_stats is None:
        print("trillm simulate: the simulation recorded nothing", file=sys.stderr)
        return 1
    span_s = max(trace[-1].timestamp / 1000, 1e-9)
    rate = len(trace) / span_s if len(trace) > 1 else math.inf
    result = RunResult(Target(args.name, "sim://" + name, "sim"), name, Arrival("rate", None, rate),
                       tuple(res.records), summarize(res.records, res.virtual_s))
    sim = {"virtual_s": res.virtual_s, "wall_s": res.wall_s, "speed": res.virtual_s / max(res.wall_s, 1e-9),
           "num_steps": res.num_steps, "num_idle_steps": res.num_idle_steps, "live_after": res.live_after,
           "final_stats": {k: getattr(res.final_stats, k) for k in res.final_stats.__slots__}}
    hit_rate = sum(r.cached_tokens or 0 for r in res.records) / max(1, sum(r.prompt_tokens or 0 for r in res.records))
    if routed is not None:
        sim["routing"] = {"replicas": args.replicas, "policy": routed.policy, "routed": routed.routed,
                          "prefix_hit_rate": hit_rate, "num_resyncs": routed.num_resyncs}
    written = report.write_all(out, [result], "serve", {"simulation": sim})
    print(report.markdown_table([result]))
    print(f"simulated {res.virtual_s:.1f} s of traffic ({len(trace)} requests, {res.num_steps} steps) in "
          f"{res.wall_s:.2f} s wall ({sim['speed']:.0f}x); blocks in use at the end: "
          f"{res.final_stats.num_blocks_used}")
    if routed is not None:
        print(f"routed over {args.replicas} replicas ({routed.policy}): prefix hit rate {hit_rate:.3f}, "
              f"requests per replica {sorted(routed.routed.values())}")
    print(f"results: {out}  ({', '.join(p.name for p in written.values())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
