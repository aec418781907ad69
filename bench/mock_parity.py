"""Parity: does the simulator predict the real engine's TTFT and ITL on a fixed trace?

Runs the same trace twice through the same client code (bench/simulate.py): once against the real engine in
the threaded EngineService on the real clock, once against the mock engine (timing model fitted by
`trillm bench profile`, run first unless --profile is given) on the virtual clock. Both share the engine
config, so the scheduler makes the same decisions. Reports TTFT and ITL p50/p90 of both and the relative
error of the prediction (the bar: within +-20%). A benchmark that reports its error, never a test.

    .venv/bin/python -m trillm.bench.mock_parity [--profile P.json] [--num-requests 12] [--rate 0.5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import trio
import trio.testing

from trillm.bench.harness.metrics import summarize
from trillm.bench.harness.results import new_results_dir, write_meta
from trillm.engine.mock.timing import relative_error


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_mock_parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=None, help="profile JSON (default: run a quick `bench profile` first)")
    p.add_argument("--perf", choices=("linear", "interpolated"), default="linear",
                   help="linear smooths the profile's noise; interpolated follows it")
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--rate", type=float, default=0.5, help="requests/s")
    p.add_argument("--input-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per trace hash id (shared prefixes)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default="results")
    return p


def _stats(records: list[Any], virtual_s: float) -> dict[str, float]:
    s = summarize(records, virtual_s)
    return {"ttft_p50": s.ttft.p50, "ttft_p90": s.ttft.p90, "itl_p50": s.itl.p50, "itl_p90": s.itl.p90,
            "e2e_p50": s.e2e.p50, "completed": s.completed, "failed": s.failed}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from trillm.engine.config import EngineConfig
    from trillm.engine.llm_engine import LLMEngine
    from trillm.engine.loader import load_model
    from trillm.engine.mock import MockModelSpec, load_perf_model, make_mock_engine, synthetic_trace
    from trillm.engine.sampling_params import SamplingParams
    from trillm.bench.simulate import simulate, simulate_async
    from trillm.web.service.engine_service import EngineService

    out = new_results_dir(args.results_dir)
    write_meta(out, "bench mock-parity", list(sys.argv[1:] if argv is None else argv), vars(args))
    profile = args.profile
    if profile is None:
        from trillm.bench import profile as bench_profile

        profile = str(out / "profile.json")
        bench_profile.main(["--batches", f"1,2,4,{args.max_num_seqs}", "--contexts", "32,128,256",
                            "--chunks", f"16,64,{args.max_num_batched_tokens}", "--out", profile]
                           + (["--model", args.model] if args.model else []))

    trace = synthetic_trace(num_requests=args.num_requests, rate=args.rate, input_len=args.input_len,
                            output_len=args.output_len, range_ratio=0.5, num_prefixes=2, prefix_blocks=1,
                            block_tokens=args.block_tokens, seed=args.seed)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          num_kv_blocks=args.max_num_seqs * 32 + 8, max_model_len=2048, model=args.model)
    loaded = load_model(args.model)
    vocab = loaded.tokenizer.vocab_size
    spec = MockModelSpec(name=loaded.name + "-mock", vocab_size=vocab, max_model_len=loaded.max_model_len,
                         num_layers=loaded.num_layers, num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim)

    # the real engine, on the real clock (one warm-up request first: first-call costs are not steady state)
    LLMEngine(config, loaded=loaded).generate([[5, 6, 7] * 8], SamplingParams(max_tokens=4))
    print(f"real engine: {len(trace)} requests over {trace[-1].timestamp / 1000:.0f} s ...", file=sys.stderr)
    t0 = time.perf_counter()
    real = trio.run(lambda: simulate_async(
        trace, EngineService(lambda: LLMEngine(config, loaded=loaded)), vocab_size=vocab,
        block_tokens=args.block_tokens, seed=args.seed,
    ))
    real_wall = time.perf_counter() - t0
    r = _stats(real.records, real.virtual_s)
    doc: dict[str, Any] = {"profile": profile, "real": r, "real_wall_s": real_wall,
                           "trace": [t.to_json() for t in trace], "real_records": [x.to_json() for x in real.records]}
    within = False
    for kind in ("linear", "interpolated"):
        model = load_perf_model(profile, kind)
        sim = simulate(trace, lambda: make_mock_engine(config, spec=spec, perf=model),
                       vocab_size=vocab, block_tokens=args.block_tokens, seed=args.seed)
        s = _stats(sim.records, sim.virtual_s)
        errors = {k: relative_error(s[k], r[k]) for k in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "e2e_p50")}
        doc[kind] = {"simulated": s, "relative_error": errors, "sim_wall_s": sim.wall_s,
                     "sim_records": [x.to_json() for x in sim.records]}
        print(f"\n{kind} timing model{' (primary)' if kind == args.perf else ''}:")
        print("| metric | real (ms) | simulated (ms) | error |")
        print("|---|---|---|---|")
        for k, e in errors.items():
            print(f"| {k} | {r[k]:.1f} | {s[k]:.1f} | {e:+.1%} |")
        if kind == args.perf:
            within = all(abs(e) <= 0.2 for k, e in errors.items() if k != "e2e_p50")
    (out / "parity.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"\n{args.perf}: TTFT/ITL p50/p90 within +-20%: {'yes' if within else 'no'}; real run {real_wall:.0f} s; "
          f"results: {out / 'parity.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
