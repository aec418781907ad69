"""`trillm bench tp`: tensor parallelism on this host: decode tokens/s and per-step time at 1 and N ranks, the
time the step's collectives take on their own, and what that predicts for N machines.

Two measurements, each in its own set of processes (MLX allows one distributed group per process):
- engine: rank 0 of an N-rank group (workers from LocalRanks) next to a one-rank engine on the full model,
  in one process, alternating trials; decode steps are timed after every prompt has its first token. The
  same process also times mlx-lm's own decode forward of the full model (its dense KVCache, no engine).
- collectives: N ranks that only communicate, running a decode step's collectives back to back: 2 all_sums of
  [B, hidden] fp32 per layer (o_proj, down_proj) and one plan broadcast; rank 0 times them. Then the same
  ranks shard the model with mlx-lm's `model.shard(group)` and time mlx-lm's own decode forward over N
  ranks: the independent reference for what the platform's collectives cost inside a forward.

On a 2-core machine N ranks share the cores and MLX's collectives busy-wait, so N ranks cannot be faster here.
The prediction for N machines assumes decode is memory-bound (a step takes time in proportion to the weight
bytes a rank reads: the sharded ones divided by N, the replicated embeddings, norms and LM head not) and a link
with the given latency and bandwidth, costed like MLX's ring all_sum (2(N-1) hops, each sending 1/N of the data).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trillm.bench.harness.results import int_list, new_results_dir, write_json, write_meta

_SHARDED = re.compile(r"\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.")
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
             "Name the planets of the solar system.", "Explain photosynthesis briefly.", "What is 17 times 23?"]


# ---- phase: engine (rank 0 of the group, plus a one-rank engine) --------------------------------------------

def _decode_steps(engine: Any, prompts: list[list[int]], steps: int) -> list[float]:
    from trillm.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}-{time.monotonic_ns()}", p, params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[:-1]  # the last step only settles the launched-ahead one


def mlx_lm_decode_s(model: Any, batch: int, steps: int) -> float:
    """mlx-lm's own decode forward (dense KVCache after a 16-token prompt), seconds per step (median)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((batch, 16), mx.int32), cache=cache))
    token = mx.zeros((batch, 1), mx.int32)
    mx.eval(model(token, cache=cache))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mx.eval(model(token, cache=cache))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def phase_engine(args: argparse.Namespace) -> dict[str, Any]:
    import trillm.kernels  # noqa: F401  (BLAS before mlx)
    from trillm.engine.config import EngineConfig
    from trillm.engine.distributed import LocalRanks, TensorParallelGroup
    from trillm.engine.llm_engine import LLMEngine
    from trillm.engine.loader import load_model, parameters
    from trillm.engine.tp_runner import TensorParallelEngine

    config = EngineConfig(model=args.model, num_kv_blocks=1024, max_num_seqs=max(args.batches),
                          max_num_batched_tokens=max(512, 64 * max(args.batches)))
    full = load_model(args.model)
    sharded = sum(v.nbytes for k, v in parameters(full.model) if _SHARDED.search(f".{k}"))
    single = LLMEngine(config, loaded=full)
    tok = full.tokenizer
    ranks = LocalRanks.start(args.size)
    try:
        tp = TensorParallelGroup.connect("ring", ranks.doorbell)
        factory = TensorParallelEngine(config, tp)
        engine = factory()
        rows = []
        for b in args.batches:
            prompts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
                       for i in range(b)]
            _decode_steps(single, prompts, 2)  # warm-up at this shape
            _decode_steps(engine, prompts, 2)
            one: list[float] = []
            many: list[float] = []
            for _ in range(args.trials):  # alternate, so machine noise hits both alike
                one += _decode_steps(single, prompts, args.steps)
                many += _decode_steps(engine, prompts, args.steps)
            rows.append({"batch": b, "step_ms_1": 1e3 * statistics.median(one),
                         "step_ms_n": 1e3 * statistics.median(many), "steps": len(one),
                         "mlx_lm_ms_1": 1e3 * mlx_lm_decode_s(full.model, b, args.steps)})
            print(f"  batch {b}: 1 rank {rows[-1]['step_ms_1']:.1f} ms/step, {args.size} ranks "
                  f"{rows[-1]['step_ms_n']:.1f} ms/step; mlx-lm's forward alone {rows[-1]['mlx_lm_ms_1']:.1f} ms",
                  flush=True)
        factory.close()
        plan_capacity = factory.channel.capacity
    finally:
        ranks.stop()
    return {"model": full.name, "num_layers": full.num_layers, "hidden": _hidden_size(full),
            "weight_bytes": full.num_bytes, "sharded_bytes": sharded, "plan_capacity": plan_capacity, "rows": rows}


def _hidden_size(loaded: Any) -> int:
    return int(loaded.model.model.embed_tokens.weight.shape[1])


# ---- phase: collectives (every rank runs the same schedule) -------------------------------------------------

def _collective_schedule(args: argparse.Namespace, rank0: bool) -> dict[str, Any]:
    import trillm.kernels  # noqa: F401
    import mlx.core as mx

    from trillm.engine.distributed import TensorParallelGroup

    tp = TensorParallelGroup.connect("ring")
    group = tp.group
    out: dict[str, Any] = {"rows": []}
    for b in args.batches:
        x = mx.ones((b, args.hidden), mx.float32)
        plan = mx.zeros((args.plan_capacity,), mx.int32)
        mx.eval(mx.distributed.all_sum(x, group=group), mx.distributed.all_sum(plan, group=group))
        samples: dict[str, list[float]] = {"step": [], "activation": [], "plan": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            mx.eval(mx.distributed.all_sum(plan, group=group))
            t1 = time.perf_counter()
            for _ in range(2 * args.layers):
                mx.eval(mx.distributed.all_sum(x, group=group))
            t2 = time.perf_counter()
            samples["plan"].append(t1 - t0)
            samples["activation"].append((t2 - t1) / (2 * args.layers))
            samples["step"].append(t2 - t0)
        out["rows"].append({"batch": b, **{f"{k}_us": 1e6 * statistics.median(v) for k, v in samples.items()}})
        if rank0:
            r = out["rows"][-1]
            print(f"  batch {b}: all_sum [{b}, {args.hidden}] fp32 {r['activation_us']:.0f} us, plan "
                  f"{r['plan_us']:.0f} us, a step's {2 * args.layers + 1} collectives {r['step_us'] / 1e3:.2f} ms",
                  flush=True)
    from trillm.engine.loader import load_model

    loaded = load_model(args.model, lazy=True)
    loaded.model.shard(group)
    mx.eval(loaded.model.parameters())
    for row in out["rows"]:
        row["mlx_lm_ms_n"] = 1e3 * mlx_lm_decode_s(loaded.model, row["batch"], args.steps)
        if rank0:
            print(f"  batch {row['batch']}: mlx-lm's own forward sharded over {tp.size}: {row['mlx_lm_ms_n']:.1f} ms",
                  flush=True)
    return out


def phase_collectives(args: argparse.Namespace) -> dict[str, Any]:
    from trillm.engine.distributed import LocalRanks

    worker = [sys.executable, "-m", "trillm.bench.tp", "--phase", "collectives-worker",
              "--batches", ",".join(map(str, args.batches)), "--hidden", str(args.hidden), "--layers",
              str(args.layers), "--plan-capacity", str(args.plan_capacity), "--repeats", str(args.repeats),
              "--steps", str(args.steps), *(["--model", args.model] if args.model else [])]
    ranks = LocalRanks.start(args.size, command=worker)
    try:
        return _collective_schedule(args, rank0=True)
    finally:
        ranks.stop()


# ---- the prediction -----------------------------------------------------------------------------------------

def ring_all_sum_s(nbytes: float, n: int, latency_s: float, bytes_per_s: float) -> float:
    """MLX's ring all_sum: reduce-scatter then all-gather, 2(N-1) hops each moving 1/N of the data."""
    return 2 * (n - 1) * (latency_s + nbytes / n / bytes_per_s)


def predict(engine: dict[str, Any], coll: dict[str, Any], n: int, latency_us: float,
            gbps: float) -> list[dict[str, Any]]:
    layers, hidden = engine["num_layers"], engine["hidden"]
    shard_frac = engine["sharded_bytes"] / engine["weight_bytes"]
    compute_frac = (1 - shard_frac) + shard_frac / n
    comm_rows = {r["batch"]: r for r in coll["rows"]}
    out = []
    for r in engine["rows"]:
        b = r["batch"]
        link = 2 * layers * ring_all_sum_s(4 * b * hidden, n, latency_us * 1e-6, gbps * 1e9 / 8)
        link += ring_all_sum_s(4 * engine["plan_capacity"], n, latency_us * 1e-6, gbps * 1e9 / 8)
        compute = r["step_ms_1"] * compute_frac
        predicted = compute + 1e3 * link
        out.append({"batch": b, "compute_ms": compute, "comm_ms": 1e3 * link, "predicted_step_ms": predicted,
                    "speedup": r["step_ms_1"] / predicted,
                    "loopback_comm_ms": comm_rows[b]["step_us"] / 1e3 if b in comm_rows else float("nan")})
    return out


def _check(value: Any, what: str) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SystemExit(f"trillm bench tp: measured nothing for {what} (got {value!r})")


# ---- the command --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="trillm bench tp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct, fp32)")
    ap.add_argument("--size", type=int, default=3, help="ranks (SmolLM2's 3 KV heads shard over 3)")
    ap.add_argument("--batches", type=int_list, default=[1, 8])
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed per trial")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30, help="collectives: repetitions of a step's schedule")
    ap.add_argument("--link-latency-us", type=float, default=50.0,
                    help="prediction: one-way latency of a hop between machines (assumed; default: 10 GbE TCP)")
    ap.add_argument("--link-gbps", type=float, default=10.0, help="prediction: link bandwidth, Gbit/s (assumed)")
    ap.add_argument("--results", default="results")
    ap.add_argument("--phase", choices=["engine", "collectives", "collectives-worker"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--plan-capacity", type=int, help=argparse.SUPPRESS)
    return ap


def _run_phase(argv: list[str], out: Path) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", "trillm.bench.tp", *argv, "--out", str(out)], check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.phase == "collectives-worker":
        from trillm.engine.distributed import die_with_parent

        die_with_parent()
        _collective_schedule(args, rank0=False)
        return 0
    if args.phase is not None:
        result = phase_engine(args) if args.phase == "engine" else phase_collectives(args)
        Path(args.out).write_text(json.dumps(result))
        return 0

    folder = new_results_dir(args.results)
    common = ["--size", str(args.size), "--batches", ",".join(map(str, args.batches))]
    print(f"engine: 1 rank and {args.size} ranks, decode steps", flush=True)
    engine = _run_phase(["--phase", "engine", *common, "--steps", str(args.steps), "--trials", str(args.trials),
                         *(["--model", args.model] if args.model else [])], folder / "engine.json")
    print(f"collectives alone, then mlx-lm's own sharded forward, {args.size} ranks on loopback", flush=True)
    coll = _run_phase(["--phase", "collectives", *common, "--hidden", str(engine["hidden"]), "--layers",
                       str(engine["num_layers"]), "--plan-capacity", str(engine["plan_capacity"]),
                       "--repeats", str(args.repeats), "--steps", str(args.steps),
                       *(["--model", args.model] if args.model else [])], folder / "collectives.json")
    for r in engine["rows"]:
        for k in ("step_ms_1", "step_ms_n", "mlx_lm_ms_1"):
            _check(r.get(k), f"{k} at batch {r['batch']}")
    for r in coll["rows"]:
        for k in ("activation_us", "plan_us", "step_us", "mlx_lm_ms_n"):
            _check(r.get(k), f"{k} at batch {r['batch']}")
    pred = predict(engine, coll, args.size, args.link_latency_us, args.link_gbps)
    pred2 = predict(engine, coll, 2, args.link_latency_us, args.link_gbps)

    sharded_pct = 100 * engine["sharded_bytes"] / engine["weight_bytes"]
    lines = [f"model {engine['model']}: {engine['num_layers']} layers, hidden {engine['hidden']}, "
             f"{engine['weight_bytes'] / 1e6:.0f} MB of weights, {sharded_pct:.0f}% of them sharded", "",
             f"| batch | trillm, 1 rank: ms/step (tok/s) | trillm, {args.size} ranks: ms/step (tok/s) "
             f"| mlx-lm forward, 1 rank / {args.size} ranks: ms | a step's collectives alone: ms |",
             "|---:|---:|---:|---:|---:|"]
    coll_by_b = {r["batch"]: r for r in coll["rows"]}
    for r in engine["rows"]:
        c = coll_by_b[r["batch"]]
        lines.append(f"| {r['batch']} | {r['step_ms_1']:.1f} ({1e3 * r['batch'] / r['step_ms_1']:.1f}) "
                     f"| {r['step_ms_n']:.1f} ({1e3 * r['batch'] / r['step_ms_n']:.1f}) "
                     f"| {r['mlx_lm_ms_1']:.1f} / {c['mlx_lm_ms_n']:.1f} | {c['step_us'] / 1e3:.2f} |")
    lines += ["", f"prediction for N machines ({args.link_latency_us:g} us per hop, {args.link_gbps:g} Gbit/s, "
              "decode memory-bound):", "",
              "| machines | batch | compute ms | link ms | predicted ms/step | vs 1 rank |",
              "|---:|---:|---:|---:|---:|---:|"]
    for n, rows in sorted({2: pred2, args.size: pred}.items()):
        for p in rows:
            lines.append(f"| {n} | {p['batch']} | {p['compute_ms']:.1f} | {p['comm_ms']:.2f} | "
                         f"{p['predicted_step_ms']:.1f} | {p['speedup']:.2f}x |")
    text = "\n".join(lines)
    print("\n" + text)
    assumptions = {"link_latency_us": args.link_latency_us, "link_gbps": args.link_gbps}
    write_json(folder / "tp.json", {"engine": engine, "collectives": coll,
                                    "prediction": {str(args.size): pred, "2": pred2}, "assumptions": assumptions})
    (folder / "tp.md").write_text(text + "\n")
    write_meta(folder, "bench tp", argv, vars(args))
    print(f"\nwrote {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
