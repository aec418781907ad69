"""`trillm bench score`: prompt tokens scored per second (prompt logprobs) against plain prefill of the same prompts.

Both run in one engine on the same prompts in one process, alternating trial by trial so machine noise hits
both alike. Plain prefill is what a generation request pays before its first token (max_tokens 1: the prompt
through the model, the head at its last position only). Scoring is what lm-eval's loglikelihood requests cost
(max_tokens 0, prompt_logprobs k: the head at every position, log-softmax, the target's logprob and rank, top k).
The prefix cache is off, so every trial computes every prompt. Target: scoring >= 0.8x prefill throughput.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import trillm.kernels  # noqa: F401  (BLAS before mlx)
from trillm.kernels import BLAS

import mlx.core as mx  # noqa: E402

from trillm.bench.harness.results import int_list, new_results_dir, write_json, write_meta  # noqa: E402
from trillm.engine.config import EngineConfig  # noqa: E402
from trillm.engine.llm_engine import LLMEngine  # noqa: E402
from trillm.engine.loader import LoadedModel, load_model  # noqa: E402
from trillm.engine.sampling_params import SamplingParams  # noqa: E402

TARGET = 0.8

_TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met to exchange grain, "
    "salt and cloth. Over the centuries it grew into a market town, then a regional capital with a cathedral, a "
    "university and a harbour. Its people built bridges, printed books, argued about taxes and wrote letters to "
    "distant relatives about the weather, the harvest and the price of bread. "
)


@dataclass(frozen=True, slots=True)
class Pass:
    tok_s: float  # prompt tokens per wall-clock second
    cpu_tok_s: float  # per second of this process's CPU time (all threads): steadier on a shared machine
    peak_mb: float  # MLX's peak memory


@dataclass(frozen=True, slots=True)
class Row:
    top_k: int
    prefill: Pass
    score: Pass

    @property
    def ratio(self) -> float:
        return self.score.tok_s / self.prefill.tok_s

    @property
    def cpu_ratio(self) -> float:
        return self.score.cpu_tok_s / self.prefill.cpu_tok_s


def make_prompts(model: LoadedModel, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of `length` tokens of English text (each starts at another offset of the text)."""
    ids = model.tokenizer.encode(_TEXT * (2 + length // 40))
    if len(ids) < length + n:
        raise SystemExit(f"the text is too short for {n} prompts of {length} tokens")
    return [ids[i : i + length] for i in range(n)]


def _peak_mb() -> float:
    return float(mx.get_peak_memory()) / 2**20


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> Pass:
    """One pass over `prompts`."""
    mx.reset_peak_memory()
    c0, t0 = time.process_time(), time.perf_counter()
    outs = engine.generate(prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(o.usage.prompt_tokens - o.usage.cached_tokens for o in outs)
    if params.prompt_logprobs is not None:
        scored = sum(len(o.prompt_logprobs or ()) for o in outs)
        if scored != sum(len(p) for p in prompts):  # a scoring pass that scored nothing must not count
            raise SystemExit(f"scoring returned {scored} prompt logprobs for {sum(map(len, prompts))} prompt tokens")
    if tokens <= 0 or dt <= 0 or cpu <= 0:
        raise SystemExit("measured nothing: no prompt tokens were computed")
    return Pass(tokens / dt, tokens / cpu, _peak_mb())


def best(passes: list[Pass]) -> Pass:
    return Pass(max(p.tok_s for p in passes), max(p.cpu_tok_s for p in passes), max(p.peak_mb for p in passes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trillm bench score", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF, fp32)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per pass")
    ap.add_argument("--length", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--top-k", type=int_list, default=[1, 5], help="prompt_logprobs values to measure (1: lm-eval)")
    ap.add_argument("--trials", type=int, default=3, help="alternating trials per mode; the best counts")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--results-dir", default="results")
    args = ap.parse_args(argv)
    if args.trials < 1 or args.prompts < 1 or args.length < 2:
        ap.error("--trials and --prompts must be >= 1, --length >= 2")

    model = load_model(args.model)
    config = EngineConfig(max_num_seqs=max(args.prompts, 1), max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=False, num_kv_blocks=args.prompts * -(-(args.length + 2) // 16) + 1)
    engine = LLMEngine(config, loaded=model)
    prompts = make_prompts(model, args.prompts, args.length)
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print(f"model {model.name}: {model.num_parameters / 1e6:.1f}M params {model.dtype}; BLAS {BLAS.name}; "
          f"{args.prompts} prompts x {args.length} tokens, chunk {args.max_num_batched_tokens}", flush=True)
    run(engine, prompts[:2], prefill)  # warm-up: kernels compiled, caches touched
    run(engine, prompts[:2], SamplingParams(max_tokens=0, prompt_logprobs=max(args.top_k)))

    rows = []
    for k in args.top_k:
        score = SamplingParams(max_tokens=0, prompt_logprobs=k)
        plain: list[Pass] = []
        scored: list[Pass] = []
        for _ in range(args.trials):  # alternate, so machine noise hits both alike
            plain.append(run(engine, prompts, prefill))
            scored.append(run(engine, prompts, score))
        row = Row(k, best(plain), best(scored))
        rows.append(row)
        print(f"prompt_logprobs={k:>2}: prefill {row.prefill.tok_s:7.1f} tok/s   scoring {row.score.tok_s:7.1f} tok/s"
              f"   ratio {row.ratio:.2f}x (target {TARGET}x; per CPU second {row.cpu_ratio:.2f}x)   "
              f"peak memory {row.prefill.peak_mb:.0f} / {row.score.peak_mb:.0f} MiB", flush=True)

    print("\n| prompt_logprobs | prefill tok/s | scoring tok/s | ratio | ratio per CPU s | peak MiB (prefill / scoring) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.top_k} | {r.prefill.tok_s:.1f} | {r.score.tok_s:.1f} | {r.ratio:.2f}x | {r.cpu_ratio:.2f}x | "
              f"{r.prefill.peak_mb:.0f} / {r.score.peak_mb:.0f} |")
    out = new_results_dir(args.results_dir)
    write_meta(out, "bench score", list(argv or []), vars(args))
    write_json(out / "score.json", {"model": model.name, "target": TARGET,
                                    "rows": [asdict(r) | {"ratio": r.ratio, "cpu_ratio": r.cpu_ratio} for r in rows]})
    print(f"wrote {out}")
    missed = [r.top_k for r in rows if r.ratio < TARGET]
    if missed:
        print(f"below the {TARGET}x target for prompt_logprobs={missed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
