"""`trillm bench window`: decode throughput of a sliding-window model at long context, with the model's windows
against the same weights with every window opened to the whole context (what the engine computed before it
passed windows to the kernels), side by side in one process, alternating.

The model is Gemma 3 shaped (mlx-lm's gemma3_text: 5 sliding layers to 1 global, head_dim 256, one KV head),
random fp32 weights built in memory (about 480 MB at the defaults; nothing is downloaded). Each trial prefills
`--batch` prompts of `--context` tokens, then times `--decode` decode steps of the whole batch. The CPU's ISA
(the kernels' SIMD path) is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import trillm.kernels  # noqa: F401  (BLAS before mlx)
from trillm.kernels import BLAS

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from trillm.engine.config import EngineConfig  # noqa: E402
from trillm.engine.llm_engine import LLMEngine  # noqa: E402
from trillm.engine.loader import LoadedModel  # noqa: E402
from trillm.engine.sampling_params import SamplingParams  # noqa: E402
from trillm.engine.tokenizer import Tokenizer  # noqa: E402


@dataclass(frozen=True)
class WindowRow:
    batch: int
    context: int
    window: int
    windowed_tok_s: float
    full_tok_s: float

    @property
    def ratio(self) -> float:
        return self.windowed_tok_s / self.full_tok_s if self.full_tok_s else 0.0


def gemma3_model(window: int, layers: int, hidden: int, vocab: int, seed: int = 0) -> nn.Module:
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=hidden, num_hidden_layers=layers,
                                 intermediate_size=hidden * 3, num_attention_heads=4, head_dim=256,
                                 rms_norm_eps=1e-6, vocab_size=vocab, num_key_value_heads=1,
                                 rope_local_base_freq=10000.0, rope_theta=1000000.0,
                                 query_pre_attn_scalar=256, sliding_window=window, sliding_window_pattern=6,
                                 max_position_embeddings=32768)  # fmt: skip
    mx.random.seed(seed)
    model = gemma3_text.Model(args)
    model.update(nn.utils.tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


def loaded(model: nn.Module, tokenizer: Tokenizer, name: str, layers: int, vocab: int) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=tokenizer, model_id=f"bench-window-{name}", name=name,
                       eos_token_ids=frozenset(), max_model_len=32768, num_layers=layers, num_kv_heads=1,
                       head_dim=256, dtype=mx.float32, num_attention_heads=4, vocab_size=vocab)


def decode_tok_s(engine: LLMEngine, batch: int, context: int, decode: int, variant: int) -> float:
    """Prefill `batch` prompts of `context` tokens, then the tokens per second of `decode` batched steps."""
    vocab = engine.limits.vocab_size
    params = SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True)
    for b in range(batch):  # distinct prompts: no prefix-cache hits between trials
        prompt = [(7 * i + 131 * b + 977 * variant) % (vocab - 1) + 1 for i in range(context)]
        engine.add_request(f"w{variant}-{b}", prompt, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    t0, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trillm bench window", description=__doc__)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed per trial")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--trials", type=int, default=2, help="alternating trials; the best counts")
    ap.add_argument("--results", default="results")
    args = ap.parse_args(argv)

    from trillm.engine.loader import load_tokenizer
    from trillm.kernels import cpu_ext

    tokenizer, _ = load_tokenizer()  # the default model's: any tokenizer serves random-weight timing
    windowed = gemma3_model(args.window, args.layers, args.hidden, args.vocab)
    full = gemma3_model(args.window, args.layers, args.hidden, args.vocab)
    full.update(windowed.parameters())
    full.model.window_size = args.context + args.decode + 16  # every window opened to the whole context
    full.args = replace(full.args, sliding_window=full.model.window_size)
    ext = cpu_ext.load()
    isa = f"{ext.SIMD}, {ext.num_threads()} threads" if ext is not None else "no CPU extension"
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (-(-(args.context + args.decode + 2) // 16)) + 8
    config = EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=2048, num_kv_blocks=blocks,
                          max_model_len=32768)
    engines = {name: LLMEngine(config, loaded=loaded(m, tokenizer, name, args.layers, args.vocab))
               for name, m in (("windowed", windowed), ("full", full))}
    n_params = sum(v.size for _, v in nn.utils.tree_flatten(windowed.parameters()))
    print(f"gemma3_text-shaped, {n_params / 1e6:.0f}M params fp32, {args.layers} layers (5 sliding : 1 global), "
          f"window {args.window}; CPU kernels {isa}; BLAS {BLAS.name}")
    impls = {name: (e.kernel_report.implementations()["paged_attention"] if e.kernel_report else "?")
             for name, e in engines.items()}
    print(f"attention kernels: windowed {impls['windowed']}, full {impls['full']}")
    rows = []
    variant = 0
    for b in batches:
        best = {"windowed": 0.0, "full": 0.0}
        for _ in range(args.trials):
            for name, engine in engines.items():
                variant += 1
                best[name] = max(best[name], decode_tok_s(engine, b, args.context, args.decode, variant))
        row = WindowRow(b, args.context, args.window, best["windowed"], best["full"])
        rows.append(row)
        print(f"batch {b:>2} at {args.context} tokens: windowed {row.windowed_tok_s:6.1f} tok/s, full "
              f"{row.full_tok_s:6.1f} tok/s, ratio {row.ratio:.2f}x", flush=True)
    if min(min(r.windowed_tok_s, r.full_tok_s) for r in rows) <= 0:
        raise SystemExit("bench window measured nothing")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"window-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"isa": isa, "blas": BLAS.name, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]},
                               indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
