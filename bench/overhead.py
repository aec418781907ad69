"""Serving overhead: output tokens/s over HTTP+SSE at concurrency C against the engine's own offline
throughput at batch C, same model, same prompts, same process. Target: served >= 0.9x offline.

    trillm bench overhead [--model M] [--concurrency 16] [--max-tokens 64] [--trials 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import trillm.kernels  # noqa: F401  (BLAS before mlx)

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.sampling_params import SamplingParams


def prompts(n: int) -> list[str]:
    return [f"Request {i}: write a long and detailed story about a lighthouse keeper named Ada number {i}."
            for i in range(n)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def offline(engine: LLMEngine, texts: list[str], max_tokens: int, tag: str) -> tuple[int, float]:
    """All prompts added at once, stepped to completion: (output tokens, seconds)."""
    ids = [engine.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        engine.add_request(f"{tag}-{i}", p, params(max_tokens))
    n = 0
    while engine.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in engine.step())
    return n, time.perf_counter() - t0


def timed_engine(config: EngineConfig, loaded: LoadedModel, busy: list[float]) -> LLMEngine:
    """An engine whose step() time is added to busy[0] (how much of the served run the engine computed)."""
    engine = LLMEngine(config, loaded=loaded)

    def on_phase(phase: str, seconds: float, _: object) -> None:
        if phase == "step":
            busy[0] += seconds

    engine.on_phase = on_phase
    return engine


async def served(loaded: LoadedModel, config: EngineConfig, texts: list[str], max_tokens: int,
                 trials: int) -> list[tuple[int, float, float]]:
    """Start the real server on a free loopback port and stream every prompt at once, `trials` times.

    Returns (output tokens, wall seconds, seconds the engine spent inside step()) per trial.
    """
    import httpx
    import trio

    from trillm.web.config import ServerConfig
    from trillm.web.server import ModelSpec, serve

    results = []
    async with trio.open_nursery() as nursery:
        busy = [0.0]
        serving = await nursery.start(partial(serve, [ModelSpec(None, partial(timed_engine, config, loaded, busy))],
                                              ServerConfig(port=0)))
        limits = httpx.Limits(max_connections=len(texts) + 4)
        async with httpx.AsyncClient(base_url=serving.url, timeout=600, limits=limits) as client:

            async def one(text: str, counts: list[int]) -> None:
                body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if event.get("usage"):
                                counts.append(event["usage"]["completion_tokens"])

            for trial in range(trials + 1):  # trial 0 warms up
                counts: list[int] = []
                batch = texts if trial else texts[:2]
                busy[0] = 0.0
                t0 = time.perf_counter()
                async with trio.open_nursery() as clients:
                    for text in batch:
                        clients.start_soon(one, text, counts)
                if trial:
                    results.append((sum(counts), time.perf_counter() - t0, busy[0]))
        nursery.cancel_scope.cancel()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trillm bench overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)

    import trio

    config = EngineConfig(model=args.model, max_num_seqs=max(args.concurrency, 1), max_num_batched_tokens=512,
                          kv_cache_memory_gb=0.5)
    texts = prompts(args.concurrency)
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    print(f"model {engine.model_name} loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    offline(engine, texts[:2], 8, "warmup")
    loaded = engine.loaded
    assert isinstance(loaded, LoadedModel)
    off: list[tuple[int, float]] = []
    srv: list[tuple[int, float, float]] = []
    for i in range(args.trials):  # alternate, so a shared machine's load hits both sides alike
        off.append(offline(engine, texts, args.max_tokens, f"t{i}"))
        srv += trio.run(served, loaded, config, texts, args.max_tokens, 1)
        print(f"trial {i}: offline {off[-1][0] / off[-1][1]:.1f} tok/s, served {srv[-1][0] / srv[-1][1]:.1f} tok/s"
              f" (engine busy {100 * srv[-1][2] / srv[-1][1]:.1f}%)", file=sys.stderr)

    off_tps = max(n / dt for n, dt in off)  # best of the trials on both sides
    srv_tps = max(n / dt for n, dt, _ in srv)
    busy = max(b / dt for _, dt, b in srv)  # share of the served wall time spent computing in step()
    result = {"model": loaded.name, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "offline_tok_s": round(off_tps, 1), "served_tok_s": round(srv_tps, 1),
              "ratio": round(srv_tps / off_tps, 3), "served_engine_busy": round(busy, 3),
              "offline_trials": off, "served_trials": srv}
    print(f"offline engine, batch {args.concurrency}:      {off_tps:8.1f} output tok/s")
    print(f"served HTTP+SSE, concurrency {args.concurrency}: {srv_tps:8.1f} output tok/s")
    print(f"ratio served/offline: {srv_tps / off_tps:.3f}  (target >= 0.9)")
    print(f"engine busy during the served run: {100 * busy:.1f}% of wall time (the rest is web-layer overhead)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
