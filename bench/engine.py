"""`trillm bench engine`: offline throughput of trillm's engine against mlx-lm, side by side.

Both run the same model object, the same prompts and the same BLAS in one process, alternating: batches
against mlx-lm's BatchGenerator, one stream's decode against `generate_step` (what stream_generate runs), and
a long prompt's prefill against mlx-lm's prompt tokens/s. Also measures memory bandwidth and reports
single-stream decode against its bound (weight bytes per token / bandwidth).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import trillm.kernels  # noqa: F401  (BLAS before mlx)
from trillm.kernels import BLAS

import mlx.core as mx  # noqa: E402

from trillm.engine.config import EngineConfig  # noqa: E402
from trillm.engine.llm_engine import LLMEngine  # noqa: E402
from trillm.engine.loader import LoadedModel, load_model  # noqa: E402
from trillm.engine.sampling_params import SamplingParams  # noqa: E402
from trillm.kernels import cpu_ext  # noqa: E402
from trillm.kernels.selfcheck import summary  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "Give me three tips for learning Python.", "Why is the sky blue?", "Describe a cat to a child.",
    "What is 17 times 23?", "Name the planets of the solar system.",
]


@dataclass(frozen=True, slots=True)
class Row:
    batch: int
    trillm_tok_s: float
    mlx_lm_tok_s: float

    @property
    def ratio(self) -> float:
        return self.trillm_tok_s / self.mlx_lm_tok_s if self.mlx_lm_tok_s else float("nan")


def make_prompts(model: LoadedModel, n: int) -> list[list[int]]:
    tok = model.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}])
            for i in range(n)]


def run_trillm(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(o.new_token_ids) for o in outs) / dt


def run_mlx_lm(model: LoadedModel, prompts: list[list[int]], max_tokens: int) -> float:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model.model, max_tokens=max_tokens, completion_batch_size=max(32, len(prompts)),
                         prefill_batch_size=min(8, len(prompts)))
    t0 = time.perf_counter()
    gen.insert([list(p) for p in prompts], max_tokens=[max_tokens] * len(prompts))
    n = 0
    done = 0
    while done < len(prompts):
        for r in gen.next_generated():
            n += 1
            done += r.finish_reason is not None
    dt = time.perf_counter() - t0
    gen.close()
    return n / dt


def memory_bandwidth_gbs(mb: int = 1024, trials: int = 5) -> float:
    """Read bandwidth with every core: numpy sums over slices of a large fp32 array (best of trials).

    (MLX's CPU reduction is single-threaded and compute-bound, so it would understate the bound.)
    """
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(mb * 1024 * 1024 // 4, dtype=np.float32)
    n = os.cpu_count() or 1
    step = len(a) // n
    best = 0.0
    with ThreadPoolExecutor(n) as pool:
        for _ in range(trials):
            t0 = time.perf_counter()
            list(pool.map(lambda i: float(a[i * step : (i + 1) * step].sum()), range(n)))
            best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def single_stream_decode_tok_s(engine: LLMEngine, prompt: list[int], n: int = 64) -> float:
    """Decode-only rate of one sequence (prefill excluded)."""
    engine.add_request("decode-probe", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def mlx_lm_decode_tok_s(model: LoadedModel, prompt: list[int], n: int = 64) -> float:
    """mlx-lm's single-stream decode rate: `generate_step`, the loop `stream_generate` drives (prefill excluded,
    as its generation_tps)."""
    from mlx_lm.generate import generate_step

    t0 = 0.0
    count = 0
    for i, _ in enumerate(generate_step(mx.array(prompt, mx.int32), model.model, max_tokens=n)):
        if i == 0:
            t0 = time.perf_counter()  # the first token comes with the prefill
        else:
            count += 1
    return count / (time.perf_counter() - t0)


def long_prompt(model: LoadedModel, n: int, variant: int) -> list[int]:
    """n tokens of chat text; `variant` changes the first token, so no two trials share a cached prefix."""
    text = " ".join(QUESTIONS) + " "
    ids: list[int] = []
    while len(ids) < n:
        ids += model.tokenizer.encode(text)
    return [100 + variant] + ids[: n - 1]


def trillm_prefill_tok_s(engine: LLMEngine, prompt: list[int]) -> float:
    """Prompt tokens/s to the first token (one request, an idle engine)."""
    engine.add_request(f"prefill-{prompt[0]}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    while not any(o.new_token_ids for o in engine.step()):
        pass
    dt = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt) / dt


def mlx_lm_prefill_tok_s(model: LoadedModel, prompt: list[int]) -> float:
    """mlx-lm's prompt tokens/s (`generate_step` to its first token, as stream_generate's prompt_tps)."""
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    next(iter(generate_step(mx.array(prompt, mx.int32), model.model, max_tokens=1)))
    return len(prompt) / (time.perf_counter() - t0)


# Constrained rows: a schema that cannot complete within the run, so every row decodes max_tokens tokens.
LONG_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 1000,
                                                          "items": {"type": "string", "maxLength": 12}}},
               "required": ["items"]}


def batch_rows(engine: LLMEngine, model: LoadedModel, batches: list[int], trials: int, max_tokens: int,
               peer: bool = True) -> list[Row]:
    """Batch decode throughput against mlx-lm's BatchGenerator (unless not `peer`: nan), best of `trials`,
    printed as it goes."""
    rows = []
    for b in batches:
        prompts = make_prompts(model, b)
        t, m = 0.0, 0.0 if peer else float("nan")
        for _ in range(trials):  # alternate, so machine noise hits both alike
            t = max(t, run_trillm(engine, prompts, max_tokens))
            if peer:
                m = max(m, run_mlx_lm(model, prompts, max_tokens))
        rows.append(Row(b, t, m))
        print(f"batch {b:>3}: trillm {t:7.1f} tok/s   mlx-lm BatchGenerator {m:7.1f} tok/s   ratio {t / m:.2f}x",
              flush=True)
    return rows


def single_stream_pair(engine: LLMEngine, model: LoadedModel, trials: int, with_peer: bool = True) -> tuple[float, float]:
    """Single-stream decode tok/s of trillm and of mlx-lm (nan unless `with_peer`), best of `trials`, alternating."""
    one = make_prompts(model, 1)[0]
    single, peer = 0.0, 0.0 if with_peer else float("nan")
    for _ in range(trials):
        single = max(single, single_stream_decode_tok_s(engine, one))
        if with_peer:
            peer = max(peer, mlx_lm_decode_tok_s(model, one))
    return single, peer


def prefill_pair(engine: LLMEngine, model: LoadedModel, tokens: int, trials: int,
                 with_peer: bool = True) -> tuple[float, float]:
    """Prefill tok/s of trillm and of mlx-lm (nan unless `with_peer`) on fresh prompts of `tokens` (no prefix
    hit), best of `trials`."""
    prefill, peer = 0.0, 0.0 if with_peer else float("nan")
    for trial in range(trials):
        prefill = max(prefill, trillm_prefill_tok_s(engine, long_prompt(model, tokens, 2 * trial)))
        if with_peer:
            peer = max(peer, mlx_lm_prefill_tok_s(model, long_prompt(model, tokens, 2 * trial + 1)))
    print(f"prefill of {tokens} tokens: trillm {prefill:.0f} tok/s, mlx-lm {peer:.0f} tok/s, "
          f"ratio {prefill / peer:.2f}x", flush=True)
    return prefill, peer


@dataclass(frozen=True, slots=True)
class ConstrainedRow:
    constrained: int
    unconstrained_tok_s_per_row: float  # decode rate of each unconstrained row
    mask_ms_per_step: float  # filling the constrained rows' bitmasks, per step that had any


def run_constrained(engine: LLMEngine, prompts: list[list[int]], k: int, max_tokens: int) -> ConstrainedRow:
    """One batch: the first k prompts under LONG_SCHEMA, the rest free; greedy, max_tokens each."""
    from trillm.engine.grammar import GrammarSpec

    grammar = GrammarSpec("json_schema", json.dumps(LONG_SCHEMA))
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, grammar=grammar if i < k else None)
              for i in range(len(prompts))]
    spent = [0.0, 0]

    def on_phase(phase: str, seconds: float, _: object) -> None:
        if phase == "masks":
            spent[0] += seconds
            spent[1] += 1

    engine.on_phase = on_phase
    try:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        dt = time.perf_counter() - t0
    finally:
        engine.on_phase = None
    free = [o for o, p in zip(outs, params) if p.grammar is None]
    tokens = sum(len(o.new_token_ids) for o in free)
    if not free or tokens == 0 or (k and spent[1] == 0):
        raise SystemExit("bench engine --constrained: measured nothing (no tokens or no mask was filled)")
    return ConstrainedRow(k, tokens / len(free) / dt, 1e3 * spent[0] / spent[1] if spent[1] else 0.0)


def constrained_main(args: argparse.Namespace, model: LoadedModel, engine: LLMEngine) -> int:
    k = args.constrained
    prompts = make_prompts(model, args.batch)
    if not 0 < k < len(prompts):
        raise SystemExit(f"--constrained must be in [1, {len(prompts) - 1}] for a batch of {len(prompts)}")
    run_constrained(engine, prompts[:4], 2, 8)  # warm: compiles the grammar, builds llguidance's tokenizer view
    base = mixed = None
    for _ in range(args.trials):  # alternate, so machine noise hits both alike; the best of each counts
        b = run_constrained(engine, prompts, 0, args.max_tokens)
        m = run_constrained(engine, prompts, k, args.max_tokens)
        base = b if base is None or b.unconstrained_tok_s_per_row > base.unconstrained_tok_s_per_row else base
        mixed = m if mixed is None or m.unconstrained_tok_s_per_row > mixed.unconstrained_tok_s_per_row else mixed
    assert base is not None and mixed is not None
    ratio = mixed.unconstrained_tok_s_per_row / base.unconstrained_tok_s_per_row
    print(f"batch {args.batch}, {args.max_tokens} tokens per row, JSON schema on {k} rows")
    print(f"unconstrained rows: {base.unconstrained_tok_s_per_row:.2f} tok/s each with K=0, "
          f"{mixed.unconstrained_tok_s_per_row:.2f} with K={k}: {ratio:.2f}x (target >= 0.90)")
    print(f"bitmask fill for {k} rows: {mixed.mask_ms_per_step:.2f} ms per step")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-constrained-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"model": model.name, "batch": args.batch, "max_tokens": args.max_tokens,
                                "k0": asdict(base), "k": asdict(mixed), "ratio": ratio}, indent=2))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trillm bench engine", description=__doc__)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct's Q4_1 GGUF)")
    ap.add_argument("--dtype", default=None,
                    help="the weights' dtype, as `trillm serve --dtype`: float32 dequantizes a quantized file, "
                         "quantized (the default) keeps it as stored")
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=2, help="alternating trials per batch size; the best counts")
    ap.add_argument("--prefill-tokens", type=int, default=1000, help="prompt length of the prefill comparison")
    ap.add_argument("--results", default="results", help="folder for the JSON result")
    ap.add_argument("--no-mlx-lm", action="store_true",
                    help="trillm's figures only (mlx-lm's CPU quantized matmul makes a quantized model's run long)")
    ap.add_argument("--constrained", type=int, default=None, metavar="K",
                    help="instead: a batch (--batch) with K rows under a JSON schema against K = 0, in one run")
    ap.add_argument("--batch", type=int, default=16, help="--constrained: the batch size")
    ap.add_argument("--speculative", default=None, metavar="ngram|draft:PATH|draft:layers=N",
                    help="instead: the engine with this speculative decoding against without, on code editing, chat "
                         "and c=16 chat (bench/engine_spec.py); draft:layers=N: the model's first N layers with its "
                         "own embedding and head, built in memory, as a self-speculative draft")
    ap.add_argument("--num-speculative-tokens", type=int, default=8, help="--speculative: tokens proposed per step")
    ap.add_argument("--spec-code-tokens", type=int, default=320, help="--speculative: the code edit's max_tokens")
    from trillm.bench.engine_hybrid import add_arguments, hybrid_main

    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.prefill_tokens < 1:  # a prefill of nothing would print a rate for nothing
        ap.error(f"--prefill-tokens must be at least 1, got {args.prefill_tokens}")
    if args.hybrid:
        return hybrid_main(args)

    model = load_model(args.model, dtype=args.dtype)
    if args.speculative is not None:
        from trillm.bench.engine_spec import spec_main

        return spec_main(args, model)
    engine = LLMEngine(EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048), loaded=model)
    if args.constrained is not None:
        return constrained_main(args, model, engine)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"model {model.name}: {model.num_parameters / 1e6:.1f}M params, {model.num_bytes / 1e6:.0f} MB "
          f"{model.dtype}; BLAS {BLAS.name} ({BLAS.path}); CPU kernels {cpu_ext.isa()}")
    if engine.kernel_report is not None:
        print(f"kernel self-check: {summary(engine.kernel_report)}")
    warm = make_prompts(model, 2)
    peer = not args.no_mlx_lm
    run_trillm(engine, warm, 8)
    if peer:
        run_mlx_lm(model, warm, 8)

    rows = batch_rows(engine, model, batches, args.trials, args.max_tokens, peer)
    bw = memory_bandwidth_gbs()
    bound = bw * 1e9 / model.num_bytes
    single, peer_single = single_stream_pair(engine, model, args.trials, peer)
    print(f"memory bandwidth {bw:.1f} GB/s -> single-stream decode bound {bound:.1f} tok/s "
          f"({model.num_bytes / 1e6:.0f} MB of weights per token)")
    print(f"single-stream decode: trillm {single:.1f} tok/s ({100 * single / bound:.0f}% of the bound, "
          f"{single * model.num_bytes / 1e9:.1f} GB/s of weights), "
          f"mlx-lm stream_generate {peer_single:.1f} tok/s, ratio {single / peer_single:.2f}x", flush=True)
    prefill, peer_prefill = prefill_pair(engine, model, args.prefill_tokens, args.trials, peer)
    if min(single, peer_single, prefill, peer_prefill, *(r.trillm_tok_s for r in rows), *(r.mlx_lm_tok_s for r in rows)) <= 0:
        raise SystemExit("bench engine measured nothing")
    print("\n| batch | trillm tok/s | mlx-lm BatchGenerator tok/s | ratio |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.batch} | {r.trillm_tok_s:.1f} | {r.mlx_lm_tok_s:.1f} | {r.ratio:.2f}x |")

    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({
        "model": model.name, "dtype": str(model.dtype), "blas": BLAS.name, "cpu_isa": cpu_ext.isa(),
        "kernels": engine.kernel_report.as_dict() if engine.kernel_report is not None else None,
        "max_tokens": args.max_tokens,
        "rows": [asdict(r) | {"ratio": r.ratio} for r in rows], "bandwidth_gbs": bw,
        "decode_bound_tok_s": bound, "single_stream_decode_tok_s": single,
        "mlx_lm_single_stream_decode_tok_s": peer_single, "prefill_tokens": args.prefill_tokens,
        "prefill_tok_s": prefill, "mlx_lm_prefill_tok_s": peer_prefill,
    }, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
