"""`trillm bench engine --hybrid`: the engine on a hybrid model against mlx-lm on the same model object.

The model is Qwen3.5 shaped (mlx-lm's qwen3_5: gated delta-net layers with a full-attention layer every
`--attention-interval`), random fp32 weights built in memory (about 550 MB at the defaults; nothing is
downloaded), with the default model's tokenizer. In one process, alternating: single-stream decode against
mlx-lm's `generate_step`, batches against its `BatchGenerator`, a long prompt's prefill, and a conversation's
second-turn TTFT with the prefix cache (resuming from a recurrent-state checkpoint) against without. First a
profile of one decode step: the share of it the recurrent layers' delta-rule update takes (mlx-lm's own
`gated_delta_update` on the step's shapes, timed alone, and trillm's `gated_delta` that the engine runs in
its place: trillm.kernels.gated_delta), which says what is left of the step beside it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS before mlx)
from trillm.kernels import BLAS

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from trillm.bench.engine import (  # noqa: E402
    batch_rows, long_prompt, make_prompts, prefill_pair, run_mlx_lm, run_trillm, single_stream_pair,
)
from trillm.engine.config import EngineConfig  # noqa: E402
from trillm.engine.llm_engine import LLMEngine  # noqa: E402
from trillm.engine.loader import LoadedModel  # noqa: E402
from trillm.engine.sampling_params import SamplingParams  # noqa: E402
from trillm.engine.outputs import RequestOutput  # noqa: E402


@dataclass(frozen=True)
class HybridFigures:
    params_m: float
    isa: str
    decode_1: tuple[float, float]  # (trillm, mlx-lm) tok/s
    batches: dict[int, tuple[float, float]]  # batch -> (trillm, mlx-lm BatchGenerator) tok/s
    prefill: tuple[float, float]
    second_turn_ttft: tuple[float, float]  # (cached, uncached) seconds
    second_turn_prefilled: tuple[int, int]  # prompt tokens computed on the second turn (cached, uncached)
    recurrent_share: float  # of one batch-16 decode step: the delta-rule updates alone (mlx-lm's)
    recurrent_ms: tuple[float, float] = (0.0, 0.0)  # those updates alone, (trillm's gated_delta, mlx-lm's) ms
    gated_delta: str = ""  # what the engine's self-check chose for the recurrence


def qwen35_model(hidden: int, layers: int, interval: int, vocab: int, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    from mlx_lm.models import qwen3_5

    text = dict(model_type="qwen3_5_text", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=vocab, rms_norm_eps=1e-6,
                linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=interval,
                tie_word_embeddings=True, max_position_embeddings=32768,
                rope_parameters={"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 100000,
                                 "partial_rotary_factor": 0.25})  # fmt: skip
    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    model.update(nn.utils.tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    return model, text


def loaded(model: nn.Module, text: dict[str, Any]) -> LoadedModel:
    from trillm.engine.loader import load_tokenizer

    tokenizer, _ = load_tokenizer()  # the default model's: any tokenizer serves random-weight timing
    return LoadedModel(model=model, tokenizer=tokenizer, model_id="bench-hybrid-qwen3_5", name="qwen3_5-bench",
                       eos_token_ids=frozenset(), max_model_len=32768, num_layers=text["num_hidden_layers"],
                       num_kv_heads=text["num_key_value_heads"], head_dim=text["head_dim"], dtype=mx.float32,
                       num_attention_heads=text["num_attention_heads"], vocab_size=text["vocab_size"])


@dataclass(frozen=True)
class StepProfile:
    mlx_lm_s: float  # the delta-rule updates of one decode step, all linear layers, mlx-lm's, timed alone
    trillm_s: float  # the same through trillm's gated_delta (g and beta as mlx-lm computes them)
    step_s: float  # the whole step through the engine
    gated_delta: str  # the engine's choice for the recurrence ("cpu", "reference": mlx-lm's own)


def recurrent_share(model: nn.Module, lm: LoadedModel, batch: int, iters: int = 5) -> StepProfile:
    """The delta-rule updates of one decode step at `batch` rows, timed alone, and the engine's whole step."""
    from mlx_lm.models import gated_delta as mlx_gdn
    from mlx_lm.models.gated_delta import gated_delta_update

    from trillm.kernels.gated_delta import gated_delta

    layers = [layer.linear_attn for layer in model.language_model.model.layers if hasattr(layer, "linear_attn")]
    g = layers[0]
    Hk, Hv, Dk, Dv = g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim
    q, k = mx.random.normal((batch, 1, Hk, Dk)), mx.random.normal((batch, 1, Hk, Dk))
    v = mx.random.normal((batch, 1, Hv, Dv))
    a, b = mx.random.normal((batch, 1, Hv)), mx.random.normal((batch, 1, Hv))
    states = [mx.zeros((batch, Hv, Dv, Dk), mx.float32) for _ in layers]
    mx.eval(q, k, v, a, b, *states)

    def updates() -> None:
        outs = [gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias, st) for layer, st in zip(layers, states)]
        mx.eval(outs)

    def ours() -> None:
        outs = [gated_delta(q, k, v, mlx_gdn.compute_g(layer.A_log, a, layer.dt_bias), mx.sigmoid(b), st)
                for layer, st in zip(layers, states)]
        mx.eval(outs)

    def timed(fn: Any) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    alone, trillm_alone = timed(updates), timed(ours)
    engine = LLMEngine(EngineConfig(max_num_seqs=batch, max_num_batched_tokens=2048, verify_model=False), loaded=lm)
    report = engine.kernel_report
    choice = next((r.implementation for r in report.ops if r.op == "gated_delta"), "?") if report else "?"
    params = SamplingParams(max_tokens=iters + 4, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(make_prompts(lm, batch)):
        engine.add_request(f"profile-{i}", p, params)
    engine.step()  # prefill
    engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return StepProfile(alone, trillm_alone, (time.perf_counter() - t0) / max(steps, 1), choice)


def second_turn(engine: LLMEngine, first: list[int], new: list[int], reply: int, tag: str) -> tuple[float, int]:
    """A two-turn conversation: the first turn's prompt and `reply` greedy tokens, then the second turn (all of
    that plus `new`): (seconds to the second turn's first token, prompt tokens it computed)."""
    params = SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True)
    out = engine.generate([first], params)[0]
    second = first + list(out.new_token_ids) + new
    engine.add_request(f"turn2-{tag}", second, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    outs: list[RequestOutput] = []
    while not any(o.new_token_ids for o in outs):
        outs = engine.step()
    ttft = time.perf_counter() - t0
    usage = next(o.usage for o in outs if o.new_token_ids)
    while engine.has_unfinished_requests():
        engine.step()
    return ttft, usage.prompt_tokens - usage.cached_tokens


def hybrid_main(args: argparse.Namespace) -> int:
    from trillm.kernels import cpu_ext

    model, text = qwen35_model(args.hybrid_hidden, args.hybrid_layers, args.hybrid_interval, args.hybrid_vocab)
    lm = loaded(model, text)
    ext = cpu_ext.load()
    isa = f"{ext.SIMD}, {ext.num_threads()} threads" if ext is not None else "no CPU extension"
    n_params = sum(v.size for _, v in nn.utils.tree_flatten(model.parameters()))
    print(f"qwen3_5-shaped, {n_params / 1e6:.0f}M params fp32 ({4 * n_params / 1e6:.0f} MB), {args.hybrid_layers} "
          f"layers (full attention every {args.hybrid_interval}); CPU kernels {isa}; BLAS {BLAS.name}", flush=True)

    prof = recurrent_share(model, lm, 16)
    alone, step = prof.mlx_lm_s, prof.step_s
    print(f"profile, batch-16 decode step: {1e3 * step:.1f} ms (the engine's recurrence: {prof.gated_delta}); the "
          f"delta-rule updates alone: mlx-lm's {1e3 * alone:.1f} ms, trillm's gated_delta {1e3 * prof.trillm_s:.1f} "
          f"ms ({100 * prof.trillm_s / step:.0f}% of the step)", flush=True)

    engine = LLMEngine(EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048), loaded=lm)
    uncached = LLMEngine(EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False,
                                      verify_model=False), loaded=lm)
    warm = make_prompts(lm, 2)
    run_trillm(engine, warm, 8)
    run_mlx_lm(lm, warm, 8)
    rows = batch_rows(engine, lm, [int(x) for x in args.batches.split(",")], args.trials, args.max_tokens)
    batches = {r.batch: (r.trillm_tok_s, r.mlx_lm_tok_s) for r in rows}
    single, peer_single = single_stream_pair(engine, lm, args.trials)
    print(f"single-stream decode: trillm {single:.1f} tok/s, mlx-lm generate_step {peer_single:.1f} tok/s, ratio "
          f"{single / peer_single:.2f}x", flush=True)
    prefill, peer_prefill = prefill_pair(engine, lm, args.prefill_tokens, args.trials)
    new = long_prompt(lm, 64, 50)[1:]  # the second turn's new message: 63 tokens
    best_c = best_u = (float("inf"), 0)
    for trial in range(args.trials):
        first = long_prompt(lm, args.prefill_tokens, 10 + trial)
        best_c = min(best_c, second_turn(engine, first, new, 32, f"c{trial}"))
        first = long_prompt(lm, args.prefill_tokens, 20 + trial)
        best_u = min(best_u, second_turn(uncached, first, new, 32, f"u{trial}"))
    print(f"second turn ({args.prefill_tokens} + 32 + {len(new)} tokens): TTFT cached {1e3 * best_c[0]:.0f} ms "
          f"({best_c[1]} tokens prefilled), uncached {1e3 * best_u[0]:.0f} ms ({best_u[1]} tokens): "
          f"{best_c[0] / best_u[0]:.2f}x (target <= 0.30x)")
    figures = HybridFigures(n_params / 1e6, isa, (single, peer_single), batches, (prefill, peer_prefill),
                            (best_c[0], best_u[0]), (best_c[1], best_u[1]), alone / step,
                            (1e3 * prof.trillm_s, 1e3 * alone), prof.gated_delta)
    if min(single, peer_single, prefill, peer_prefill, *(x for pair in batches.values() for x in pair)) <= 0 or \
            best_c[1] >= best_u[1] or not best_u[0] < float("inf"):
        raise SystemExit("bench engine --hybrid measured nothing (or the second turn never hit the prefix cache)")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-hybrid-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(asdict(figures) | {"blas": BLAS.name, "max_tokens": args.max_tokens,
                                                  "prefill_tokens": args.prefill_tokens}, indent=2))
    print(f"wrote {path}")
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hybrid", action="store_true",
                    help="instead: a Qwen3.5-shaped hybrid built in memory (bench/engine_hybrid.py)")
    ap.add_argument("--hybrid-hidden", type=int, default=1024, help="--hybrid: hidden size")
    ap.add_argument("--hybrid-layers", type=int, default=6, help="--hybrid: layers")
    ap.add_argument("--hybrid-interval", type=int, default=3, help="--hybrid: a full-attention layer every N")
    ap.add_argument("--hybrid-vocab", type=int, default=49152, help="--hybrid: vocabulary (tied embeddings)")
