"""`trillm bench engine --speculative ngram|draft:PATH|draft:layers=N`: the engine with and without speculative
decoding, side by side.

One model object, two engines (speculation off and on), alternating trials, three workloads: code editing (the
prompt holds a file, the answer rewrites it: its output repeats its input), plain chat, and chat at c=16.
Reports output tok/s of each, the ratio, acceptance rate and tokens per forward of the speculating rows, and
whether the greedy outputs are identical token for token (a difference fails the run).

`draft:layers=N` builds a draft in memory from the target itself: its first N decoder layers, then its own final
norm and LM head (the same weights, shared): a self-speculative draft of the same tokenizer, for a model that
has no smaller sibling at hand. Its proposals are the target's early-exit guesses.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import trillm.kernels  # noqa: F401  (BLAS before mlx)
from trillm.kernels import BLAS, cpu_ext
from trillm.bench.harness.prompts import CHAT, CODE_TASK
from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.paged_model import decoder_stack
from trillm.engine.sampling_params import SamplingParams

@dataclass(frozen=True, slots=True)
class SpecRow:
    workload: str
    concurrency: int
    off_tok_s: float
    on_tok_s: float
    acceptance_rate: float
    tokens_per_forward: float  # of the speculating rows' verify forwards
    identical: bool

    @property
    def ratio(self) -> float:
        return self.on_tok_s / self.off_tok_s if self.off_tok_s else float("nan")


def chat_prompt(model: LoadedModel, text: str) -> list[int]:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def timed_generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[tuple[int, ...]]]:
    """Output tok/s from the first token on (the prefill is the same with or without speculation), and the
    outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [f"spec-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    t0 = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if t0 is None and all(out.values()):
            t0, base = time.perf_counter(), sum(len(v) for v in out.values())
    assert t0 is not None
    dt = time.perf_counter() - t0
    return (sum(len(v) for v in out.values()) - base) / dt, [tuple(out[r]) for r in ids]


def compare(name: str, off: LLMEngine, on: LLMEngine, prompts: list[list[int]], max_tokens: int,
            trials: int) -> SpecRow:
    best_off = best_on = 0.0
    identical = True
    before = on.statistics()
    for _ in range(trials):  # alternate, so machine noise hits both alike
        r_off, o_off = timed_generate(off, prompts, max_tokens)
        r_on, o_on = timed_generate(on, prompts, max_tokens)
        best_off, best_on = max(best_off, r_off), max(best_on, r_on)
        identical &= o_off == o_on
    after = on.statistics()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    verifies = after.spec_verifies - before.spec_verifies
    row = SpecRow(name, len(prompts), best_off, best_on, accepted / drafted if drafted else 0.0,
                  1 + accepted / verifies if verifies else 1.0, identical)
    print(f"{name:>12} c={row.concurrency:<3} off {row.off_tok_s:6.1f} tok/s  on {row.on_tok_s:6.1f} tok/s  "
          f"{row.ratio:.2f}x  acceptance {row.acceptance_rate:.2f}  tokens/forward {row.tokens_per_forward:.2f}  "
          f"identical {row.identical}", flush=True)
    return row


def truncated_draft(model: LoadedModel, num_layers: int) -> LoadedModel:
    """The model's first `num_layers` decoder layers with its own embedding, final norm and head: the same
    module objects (no weight is copied), in a shallow copy of the model whose stack holds fewer layers."""
    stack = decoder_stack(model.model)
    if stack is None or not 1 <= num_layers < model.num_layers:
        raise SystemExit(f"draft:layers={num_layers}: needs a model with a decoder stack of more than that many layers")
    inner = copy.copy(stack.stack)
    inner.layers = stack.stack.layers[:num_layers]
    outer = copy.copy(model.model)
    if stack.parent is not model.model:
        raise SystemExit("draft:layers=N: the decoder stack must hang directly off the model")
    outer[stack.key] = inner
    return dataclasses.replace(model, model=outer, num_layers=num_layers, name=f"{model.name}[:{num_layers} layers]",
                               model_id=f"{model.model_id}:first-{num_layers}-layers")


def spec_main(args: argparse.Namespace, model: LoadedModel) -> int:
    base = dict(max_num_seqs=64, max_num_batched_tokens=2048)
    off = LLMEngine(EngineConfig(**base), loaded=model)  # type: ignore[arg-type]
    # Built after `off`: the draft shares the layers and head the engine's fused ops were installed in.
    method, _, arg = args.speculative.partition(":")
    draft = truncated_draft(model, int(arg.partition("=")[2])) if arg.startswith("layers=") else None
    speculative = f"draft:{draft.name}" if draft is not None else args.speculative
    on = LLMEngine(EngineConfig(**base, speculative=speculative,  # type: ignore[arg-type]
                                num_speculative_tokens=args.num_speculative_tokens), loaded=model, draft=draft)
    if on.draft is not None:
        d = on.draft
        print(f"draft {d.name}: {d.num_layers} of {model.num_layers} layers, {d.num_parameters / 1e6:.1f}M parameters "
              f"of {model.num_parameters / 1e6:.1f}M")
    print(f"model {model.name} {model.dtype}; BLAS {BLAS.name}; CPU kernels {cpu_ext.isa()}; --speculative "
          f"{args.speculative} --num-speculative-tokens {args.num_speculative_tokens}")
    warm = [chat_prompt(model, CHAT[0])]
    timed_generate(off, warm, 8)
    timed_generate(on, warm, 8)
    code = chat_prompt(model, CODE_TASK)
    rows = [
        compare("code-edit", off, on, [code], args.spec_code_tokens, args.trials),
        compare("chat", off, on, [chat_prompt(model, CHAT[3])], args.max_tokens, args.trials),
        compare("chat", off, on, [chat_prompt(model, f"{CHAT[i % len(CHAT)]} (#{i})") for i in range(16)],
                args.max_tokens, args.trials),
    ]
    if min(min(r.off_tok_s, r.on_tok_s) for r in rows) <= 0:
        raise SystemExit("bench engine --speculative measured nothing")
    print("\n| workload | c | off tok/s | on tok/s | ratio | acceptance | tokens/forward | identical |\n"
          "|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r.workload} | {r.concurrency} | {r.off_tok_s:.1f} | {r.on_tok_s:.1f} | {r.ratio:.2f}x | "
              f"{r.acceptance_rate:.2f} | {r.tokens_per_forward:.2f} | {'yes' if r.identical else 'NO'} |")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-spec-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"model": model.name, "dtype": str(model.dtype), "blas": BLAS.name,
                                "cpu_isa": cpu_ext.isa(), "speculative": args.speculative,
                                "draft_layers": on.draft.num_layers if on.draft is not None else None, "num_speculative_tokens": args.num_speculative_tokens,
                                "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}, indent=2))
    print(f"wrote {path}")
    if not all(r.identical for r in rows):
        raise SystemExit("greedy output with speculation differs from without")
    return 0
