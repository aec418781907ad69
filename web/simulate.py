"""`trillm simulate TRACE`: replay a request trace against the mock engine in virtual time.

The trace's requests go through the same InlineEngineService (and so the same GenerationHandles, scheduler
and block manager) as `trillm serve --mock`, but on `trio.testing.MockClock(autojump_threshold=0)`: time
jumps whenever every task waits, so an hour of traffic takes seconds. Each simulated client records what
`trillm bench serve` records (TTFT, ITL, TPOT, E2E, usage) against the virtual clock, and the run is written
with the same report code: serve.json / serve.md / plots under RESULTS_DIR/<timestamp>/.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import trio.testing

from trillm.engine.config import EngineConfig
from trillm.engine.errors import EngineError
from trillm.engine.mock import (
    MockModelSpec, PerfModel, PolynomialModel, Recording, TraceRequest, load_perf_model, load_trace, make_mock_engine,
    prompt_tokens, synthetic_trace,
)
from trillm.engine.sampling_params import SamplingParams
from trillm.web.mock_service import InlineEngineService
from trillm.web.service import Engine, EngineService
from trillm.web.stream import GenerationFailed


@dataclass(slots=True)
class SimulationResult:
    records: list[Any]  # bench.metrics.RequestRecord
    virtual_s: float  # simulated time from the first arrival to the last completion
    wall_s: float
    num_steps: int
    num_idle_steps: int
    final_stats: Any  # EngineStatistics after the run
    live_after: int  # requests the service still tracks after the run (should be 0)
    extra: dict[str, Any] = field(default_factory=dict)


async def _client(service: EngineService, req: TraceRequest, index: int, prompt: list[int], t0: float,
                  records: list[Any]) -> None:
    from trillm.bench.metrics import RequestRecord

    start = trio.current_time()
    chunks: list[float] = []
    usage = None
    chars = 0
    error: tuple[str, str] | None = None
    try:
        handle = service.submit(prompt, SamplingParams(max_tokens=req.output_length, ignore_eos=True))
        with handle:
            await handle.wait_admitted()
            while True:
                try:
                    out = await handle.receive()
                except trio.EndOfChannel:
                    break
                if out.new_token_ids:
                    chunks.append(trio.current_time() - start)
                chars += len(out.new_text)
                usage = out.usage
    except EngineError as exc:
        error = (type(exc).__name__, str(exc))
    except GenerationFailed as exc:
        error = ("GenerationFailed", str(exc))
    records.append(RequestRecord(
        request_id=f"trace-{index}", start=start - t0, latency=trio.current_time() - start,
        chunk_times=tuple(chunks), prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        cached_tokens=usage.cached_tokens if usage else None, num_chars=chars,
        error_kind=error[0] if error else None, error=error[1] if error else None,
    ))


async def simulate_async(trace: list[TraceRequest], engine_factory: Callable[[], Engine], *,
                         block_tokens: int = 512, vocab_size: int, seed: int = 0,
                         on_step: Callable[[Engine], None] | None = None,
                         service: EngineService | None = None) -> SimulationResult:
    """Replay trace on the current trio clock against a fresh InlineEngineService (or the given service,
    e.g. the threaded EngineService around the real engine, for parity runs in real time)."""
    records: list[Any] = []
    wall0 = time.perf_counter()
    if service is None:
        # Statistics only at the end: LLMEngine.statistics() is O(blocks + steps in its wall-clock rate window).
        service = InlineEngineService(engine_factory, on_step=on_step, stats_interval_s=math.inf,
                                      stats_when_idle=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        t0 = trio.current_time()
        async with trio.open_nursery() as clients:
            for i, req in enumerate(trace):
                await trio.sleep_until(t0 + req.timestamp / 1000)
                prompt = prompt_tokens(req, i, vocab_size=vocab_size, block_tokens=block_tokens, seed=seed)
                clients.start_soon(_client, service, req, i, prompt, t0, records)
        virtual = trio.current_time() - t0
        if isinstance(service, InlineEngineService):
            engine = service.engine
            assert engine is not None
            while engine.has_unfinished_requests():  # settle the step in flight
                await trio.sleep(0.001)
            stats, steps, idle = engine.statistics(), service.num_steps, service.num_idle_steps
        else:
            await trio.sleep(0.2)  # the engine thread's next hop publishes its statistics
            stats, steps, idle = service.statistics(), getattr(service.statistics(), "num_steps", 0), 0
        nursery.cancel_scope.cancel()
    records.sort(key=lambda r: r.start)
    return SimulationResult(records, virtual, time.perf_counter() - wall0, steps, idle, stats, len(service._live))


def simulate(trace: list[TraceRequest], engine_factory: Callable[[], Engine], *, vocab_size: int,
             block_tokens: int = 512, seed: int = 0) -> SimulationResult:
    """Run simulate_async on a virtual clock (trio.testing.MockClock with autojump_threshold=0)."""
    return trio.run(
        lambda: simulate_async(trace, engine_factory, block_tokens=block_tokens, vocab_size=vocab_size, seed=seed),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )


def perf_from_args(args: argparse.Namespace, spec: MockModelSpec) -> PerfModel:
    if args.profile:
        return load_perf_model(args.profile, args.perf)
    if args.perf == "polynomial":
        return PolynomialModel()
    return spec.roofline(mem_bandwidth_gbps=args.mem_bandwidth_gbps, tflops=args.tflops)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine and timing-model flags shared by `simulate` and `serve --mock`."""
    g = p.add_argument_group("mock engine")
    g.add_argument("--profile", default=None, help="profile JSON from `trillm bench profile` (else a roofline model)")
    g.add_argument("--perf", choices=("linear", "interpolated", "polynomial"), default="linear",
                   help="with --profile: its linear fit or interpolation; polynomial: Dynamo's default constants")
    g.add_argument("--mem-bandwidth-gbps", type=float, default=100.0, help="roofline: memory bandwidth")
    g.add_argument("--tflops", type=float, default=4.0, help="roofline: compute")
    g.add_argument("--recording", default=None, help="JSONL of prompt/output token ids to replay")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-waiting", type=int, default=100_000)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--mock-seed", type=int, default=0)


def engine_factory_from_args(args: argparse.Namespace, *, speedup: float = 1.0) -> tuple[Callable[[], Engine], MockModelSpec]:
    spec = MockModelSpec()
    config = EngineConfig(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.mock_seed,
    )
    perf = perf_from_args(args, spec)
    recording = Recording.load(args.recording) if args.recording else None

    def factory() -> Engine:
        return make_mock_engine(config, spec=spec, perf=perf, seed=args.mock_seed, speedup=speedup,
                                recording=recording)  # type: ignore[return-value]

    return factory, spec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trillm simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", help="JSONL trace (mooncake style); see --synthetic")
    p.add_argument("--synthetic", action="store_true",
                   help="generate the trace instead (see --rate, --duration, ...); with TRACE, also write it there")
    p.add_argument("--rate", type=float, default=2.0, help="synthetic: requests/s")
    p.add_argument("--duration", type=float, default=60.0, help="synthetic: seconds of traffic")
    p.add_argument("--input-len", type=int, default=512, help="synthetic")
    p.add_argument("--output-len", type=int, default=128, help="synthetic")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--name", default="mock-sim", help="server label in the report")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """`trillm simulate`: write serve.json / serve.md (as `trillm bench serve`) plus sim.json."""
    from trillm.bench import report
    from trillm.bench.arrival import Arrival
    from trillm.bench.client import Target
    from trillm.bench.metrics import summarize
    from trillm.bench.results import new_results_dir, write_meta
    from trillm.bench.runner import RunResult

    args = build_parser().parse_args(argv)
    if args.synthetic:
        trace = synthetic_trace(duration_s=args.duration, rate=args.rate, input_len=args.input_len,
                                output_len=args.output_len, block_tokens=args.block_tokens, seed=args.seed)
        if args.trace:
            from trillm.engine.mock import save_trace

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
    factory, spec = engine_factory_from_args(args)
    out = new_results_dir(args.results_dir)
    write_meta(out, "simulate", list(sys.argv[1:] if argv is None else argv), vars(args))
    res = simulate(trace, factory, vocab_size=spec.vocab_size, block_tokens=args.block_tokens, seed=args.seed)
    span_s = max(trace[-1].timestamp / 1000, 1e-9)
    rate = len(trace) / span_s if len(trace) > 1 else math.inf
    run = RunResult(Target(args.name, "sim://" + name, "sim"), name, Arrival("rate", None, rate),
                    tuple(res.records), summarize(res.records, res.virtual_s))
    sim = {"virtual_s": res.virtual_s, "wall_s": res.wall_s, "speed": res.virtual_s / max(res.wall_s, 1e-9),
           "num_steps": res.num_steps, "num_idle_steps": res.num_idle_steps, "live_after": res.live_after,
           "final_stats": {k: getattr(res.final_stats, k) for k in res.final_stats.__slots__}}
    written = report.write_all(out, [run], "serve", {"simulation": sim})
    print(report.markdown_table([run]))
    print(f"simulated {res.virtual_s:.1f} s of traffic ({len(trace)} requests, {res.num_steps} steps) in "
          f"{res.wall_s:.2f} s wall ({sim['speed']:.0f}x); blocks in use at the end: "
          f"{res.final_stats.num_blocks_used}")
    print(f"results: {out}  ({', '.join(p.name for p in written.values())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
