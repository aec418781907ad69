"""`trillm bench kv-cache`: the KV cache's dtype (--kv-cache-dtype) on the default model: accuracy against the
float32 cache, capacity, and decode speed at long context.

For each dtype (`--dtypes`, float32 first: the others are compared with it), an engine over SmolLM2-135M
(the default model, its Q4_1 weights computed in float32):
  1. accuracy: the prompt logprobs of `--score-tokens` tokens of English (the Python and Apache licence
     texts shipped with typing_extensions and transformers) against the float32 cache's: mean and max
     |delta logprob|; and greedy agreement: `--prompts` slices of that text, `--greedy-tokens` greedy tokens
     each, the share of positions equal to float32's and the prompts whose tokens all are
  2. capacity: the pool's bytes per token (KVLayout.bytes_per_block) and tokens per GiB
  3. decode at `--context` tokens: one row prefilled to the context, then the time per decode step, and the
     paged attention op alone (the engine's selected implementation, one layer) at batch 1 and
     `--attention-batch` over contexts of that length
The CPU's ISA and the machine's load average are printed with the figures; nothing measured exits 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from trillm.engine.config import KV_CACHE_DTYPES, EngineConfig  # noqa: E402
from trillm.engine.llm_engine import LLMEngine  # noqa: E402
from trillm.engine.loader import LoadedModel  # noqa: E402
from trillm.engine.sampling_params import SamplingParams  # noqa: E402
from trillm.kernels import cpu_ext  # noqa: E402
from trillm.kernels.layout import ModelShapes, random_batch  # noqa: E402

TEXTS = (("typing_extensions", "LICENSE"), ("transformers", "LICENSE"))


def english_text() -> str:
    """The licence texts of two installed packages (English prose, fixed by their pinned versions)."""
    parts = []
    for dist, name in TEXTS:
        files = importlib.metadata.distribution(dist).files or []
        path = next((f for f in files if f.name == name), None)
        if path is None:
            raise SystemExit(f"bench kv-cache: {dist}'s {name} is not installed")
        parts.append(Path(str(path.locate())).read_text())
    return "\n\n".join(parts)


@dataclass
class Row:
    dtype: str
    bytes_per_token: float
    tokens_per_gib: float
    scored_tokens: int
    mean_abs_dlogprob: float | None
    max_abs_dlogprob: float | None
    greedy_positions_equal: float | None
    greedy_prompts_equal: str | None
    decode_ms: float  # per step, one row at the context
    attention_ms_b1: float
    attention_ms_bn: float
    attention_impl: str


def engine_for(kv: str, context: int) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_dtype=kv, max_model_len=context + 64, max_num_seqs=8,
                                  max_num_batched_tokens=512, num_kv_blocks=8 * (context + 64) // 16 + 8))


def prompt_logprobs(eng: LLMEngine, ids: list[int]) -> np.ndarray:
    out = eng.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    return np.array([e.logprob for e in out.prompt_logprobs[1:] if e is not None])


def greedy(eng: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [list(o.new_token_ids) for o in eng.generate(prompts, params)]


def decode_ms(eng: LLMEngine, ids: list[int], steps: int) -> float:
    """Prefill one row of `ids`, then the median wall time of its next `steps` decode steps."""
    eng.add_request("decode", ids, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def attention_ms(eng: LLMEngine, kv_dtype: str, batch: int, context: int, iters: int = 10) -> tuple[float, str]:
    """One layer's paged attention at decode (the engine's chosen implementation) over `batch` rows."""
    lm = eng.loaded
    assert isinstance(lm, LoadedModel)
    pool = eng.runner.pool  # type: ignore[attr-defined]
    shapes = ModelShapes(lm.num_attention_heads, lm.num_kv_heads, lm.head_dim, 16, mx.float32,
                         kv_dtype=None if kv_dtype == "float32" else kv_dtype)
    b = random_batch(shapes, [context] * batch, 1, seed=batch)
    fn = pool.kernels.paged_attention
    args = (b.q, b.k_pool, b.v_pool, b.block_tables, b.context_lens)
    mx.eval(fn(*args, scale=lm.head_dim**-0.5, **b.scales))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn(*args, scale=lm.head_dim**-0.5, **b.scales))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, eng.kernel_report.implementation("paged_attention") if eng.kernel_report else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trillm bench kv-cache", description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="fp32,fp16,int8", help="--kv-cache-dtype values, fp32 first")
    ap.add_argument("--score-tokens", type=int, default=3000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192, help="capped at the model's context less the decode")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--attention-batch", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "fp32" or any(d not in KV_CACHE_DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes: fp32 first, then any of {', '.join(KV_CACHE_DTYPES)}")
    print(f"CPU kernels: {cpu_ext.isa()}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    text = english_text()
    rows: list[Row] = []
    base_lp: np.ndarray | None = None
    base_greedy: list[list[int]] | None = None
    for kv in dtypes:
        eng = engine_for(kv, args.context)
        ids = eng.tokenizer.encode(text)
        if len(ids) < args.score_tokens:
            raise SystemExit(f"the text has {len(ids)} tokens, fewer than --score-tokens {args.score_tokens}")
        lp = prompt_logprobs(eng, ids[: args.score_tokens])
        prompts = [ids[i * 200: i * 200 + 128] for i in range(args.prompts)]
        toks = greedy(eng, prompts, args.greedy_tokens)
        context = min(args.context, eng.max_model_len - args.decode_steps - 1)  # SmolLM2's is 8192 in all
        long_ids = (ids * (context // len(ids) + 1))[:context]
        print(f"{kv}: scored {len(lp)} tokens, greedy done; decode at {context} tokens", flush=True)
        step_ms = decode_ms(eng, long_ids, args.decode_steps)
        assert eng.kv_layout is not None
        per_token = eng.kv_layout.bytes_per_block(16, eng.loaded.dtype) / 16
        kv_name = eng.kv_layout.kv_dtype or "float32"
        a1, impl = attention_ms(eng, kv_name, 1, context)
        an, _ = attention_ms(eng, kv_name, args.attention_batch, context)
        if base_lp is None:
            base_lp, base_greedy = lp, toks
            stats: dict[str, Any] = dict(mean_abs_dlogprob=None, max_abs_dlogprob=None, greedy_positions_equal=None,
                                         greedy_prompts_equal=None)
        else:
            assert base_greedy is not None
            d = np.abs(lp - base_lp)
            same = sum(a == b for w, g in zip(base_greedy, toks) for a, b in zip(w, g))
            stats = dict(mean_abs_dlogprob=float(d.mean()), max_abs_dlogprob=float(d.max()),
                         greedy_positions_equal=same / sum(map(len, base_greedy)),
                         greedy_prompts_equal=f"{sum(w == g for w, g in zip(base_greedy, toks))}/{len(toks)}")
        row = Row(kv, per_token, 2**30 / per_token, len(lp), decode_ms=step_ms, attention_ms_b1=a1,
                  attention_ms_bn=an, attention_impl=impl, **stats)
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)
        del eng
        mx.clear_cache()
    base = rows[0]
    print(f"\nSmolLM2-135M, {base.scored_tokens} scored tokens, {args.prompts} x {args.greedy_tokens} greedy tokens, "
          f"decode at {context} tokens; attention: one layer, B=1 and B={args.attention_batch}")
    print("| KV cache | bytes/token | tokens in the same memory | mean / max abs dlogprob vs fp32 | greedy positions "
          "(prompts) equal | decode step at ctx | attention B=1 | attention B=N |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        acc = "-" if r.mean_abs_dlogprob is None else f"{r.mean_abs_dlogprob:.4f} / {r.max_abs_dlogprob:.3f}"
        agree = "-" if r.greedy_positions_equal is None else f"{r.greedy_positions_equal:.1%} ({r.greedy_prompts_equal})"
        print(f"| {r.dtype} | {r.bytes_per_token:.0f} | {base.bytes_per_token / r.bytes_per_token:.2f}x | {acc} | {agree} "
              f"| {r.decode_ms:.1f} ms ({base.decode_ms / r.decode_ms:.2f}x) | {r.attention_ms_b1:.2f} ms "
              f"({base.attention_ms_b1 / r.attention_ms_b1:.2f}x) | {r.attention_ms_bn:.2f} ms "
              f"({base.attention_ms_bn / r.attention_ms_bn:.2f}x) [{r.attention_impl}] |")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if not all(r.decode_ms > 0 and r.attention_ms_b1 > 0 and r.scored_tokens >= min(1000, args.score_tokens - 1)
               for r in rows):
        raise SystemExit("bench kv-cache measured nothing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
