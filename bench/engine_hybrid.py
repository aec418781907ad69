"""`trillm bench engine --hybrid`: the engine on a hybrid model against mlx-lm on the same model object.

The model (`--hybrid-family`) is Qwen3.5 shaped (mlx-lm's qwen3_5: gated delta-net layers with a full-attention
layer every `--hybrid-interval`; about 550 MB at the defaults), Nemotron-H shaped (nemotron_h: Mamba-2 mixers,
32 heads of 64, state 128 in 8 groups, with a full-attention mixer every `--hybrid-interval`, each mixer followed
by an MLP block; about 650 MB) or Mamba-2 only (mamba2: the same mixers, tied embeddings), random fp32 weights
built in memory (nothing is downloaded), with the default model's tokenizer. In one process, alternating:
single-stream decode against mlx-lm's `generate_step`, batches against its `BatchGenerator`, a long prompt's
prefill, and a conversation's second-turn TTFT with the prefix cache (resuming from a recurrent-state
checkpoint) against without. First a profile of one decode step: the share of it the recurrent layers'
delta-rule update takes (mlx-lm's own `gated_delta_update` on the step's shapes, timed alone, and trillm's
`gated_delta` that the engine runs in its place: trillm.kernels.gated_delta), which says what is left of the
step beside it. For the Mamba-2 families the profile is of the state-space update instead (mlx-lm's
`ssm_update`, which the engine runs: on CPU its `ssm_attn`) and of the mixer's other parts (projections,
conv1d, gated norm), the MLPs and the LM head, each timed alone over its layers.
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
    family: str = "qwen3_5"
    parts_ms: dict[str, float] | None = None  # the Mamba-2 families: one batch-16 decode step's parts, timed alone


FAMILIES = ("qwen3_5", "nemotron_h", "mamba2")


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


# Nemotron-H-like Mamba-2 mixers (Nemotron-H-8B: 128 heads of 64, state 128, 8 groups; here a quarter of the
# heads for a 1,024 hidden size).
_MAMBA = dict(mamba_heads=32, mamba_head_dim=64, state=128, groups=8, conv=4)


def nemotron_h_pattern(layers: int, interval: int) -> str:
    """`layers` mixers, every `interval`-th full attention, the rest Mamba-2, each followed by an MLP block."""
    return "".join(("*" if (i + 1) % interval == 0 else "M") + "-" for i in range(layers))


def ssm_model(family: str, hidden: int, layers: int, interval: int, vocab: int,
              seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A Nemotron-H- or Mamba-2-shaped model, random fp32 weights; the dict holds the facts `loaded` needs."""
    m = _MAMBA
    if family == "nemotron_h":
        from mlx_lm.models import nemotron_h as module

        config: dict[str, Any] = dict(
            model_type="nemotron_h", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            max_position_embeddings=32768, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            attention_bias=False, mamba_num_heads=m["mamba_heads"], mamba_head_dim=m["mamba_head_dim"],
            mamba_proj_bias=False, ssm_state_size=m["state"], conv_kernel=m["conv"], n_groups=m["groups"],
            mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
            hybrid_override_pattern=nemotron_h_pattern(layers, interval))
        facts = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    elif family == "mamba2":
        from mlx_lm.models import mamba2 as module

        config = dict(
            model_type="mamba2", vocab_size=vocab, hidden_size=hidden, intermediate_size=m["mamba_heads"] *
            m["mamba_head_dim"], num_heads=m["mamba_heads"], head_dim=m["mamba_head_dim"], state_size=m["state"],
            num_hidden_layers=layers, layer_norm_epsilon=1e-5, conv_kernel=m["conv"], n_groups=m["groups"],
            use_bias=False, use_conv_bias=True, tie_word_embeddings=True, time_step_limit=(0.0, float("inf")),
            time_step_rank="auto", max_position_embeddings=32768)
        # No attention: the SSM heads stand in, as the loader does (facts for the kernel self-check's shapes).
        facts = dict(num_attention_heads=m["mamba_heads"], num_key_value_heads=m["mamba_heads"],
                     head_dim=m["mamba_head_dim"])
    else:
        raise ValueError(f"not a Mamba-2 family: {family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(nn.utils.tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    return model, facts | dict(num_hidden_layers=len(model.layers), vocab_size=vocab, family=family)


def loaded(model: nn.Module, text: dict[str, Any]) -> LoadedModel:
    from trillm.engine.loader import load_tokenizer

    family = text.get("family", "qwen3_5")
    tokenizer, _ = load_tokenizer()  # the default model's: any tokenizer serves random-weight timing
    return LoadedModel(model=model, tokenizer=tokenizer, model_id=f"bench-hybrid-{family}", name=f"{family}-bench",
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
    step, choice = engine_step_s(lm, batch, iters)
    return StepProfile(alone, trillm_alone, step, choice)


def engine_step_s(lm: LoadedModel, batch: int, iters: int, kernels: str = "auto") -> tuple[float, str]:
    """One decode step at `batch` rows through a fresh engine (seconds), and its choice for the recurrence."""
    engine = LLMEngine(EngineConfig(max_num_seqs=batch, max_num_batched_tokens=2048, verify_model=False,
                                    kernels=kernels), loaded=lm)
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
    return (time.perf_counter() - t0) / max(steps, 1), choice


def ssm_profile(model: nn.Module, lm: LoadedModel, batch: int, iters: int = 10,
                kernels: str = "auto") -> tuple[StepProfile, dict[str, float]]:
    """A Mamba-2 family's decode step at `batch` rows: the engine's whole step, and its parts timed alone over
    their layers with trillm's ops on (after the engine installed them), in ms: the state-space update, mlx-lm's
    `ssm_update` and the one the engine runs (its rebound module function: trillm's kernel where the self-check
    chose it), the in/out projections, the conv window (concat + depthwise conv1d +
    SiLU), the gated RMSNorm, the MLP blocks, the LM head. `kernels`: the engine's self-check mode."""
    import sys

    from mlx_lm.models.ssm import ssm_update

    from trillm.engine.fused_ops import fused_ops

    step, _ = engine_step_s(lm, batch, iters, kernels)  # first: the engine installs its fused ops in `model`
    blocks = list(model.layers)
    mixers = [b.mixer for b in blocks if hasattr(b.mixer, "A_log")]
    mlps = [b for b in blocks if getattr(b, "block_type", "") == "-"]
    m = mixers[0]
    engine_ssm = getattr(sys.modules[type(m).__module__], "ssm_update")  # rebound by install_fused_ops
    H, P, N, G, K = m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups, m.conv_kernel_size
    hidden = m.hidden_size
    x = mx.random.normal((batch, 1, hidden))
    xs, dt = mx.random.normal((batch, 1, H, P)), mx.random.normal((batch, 1, H))
    Bm, Cm = mx.random.normal((batch, 1, G, N)), mx.random.normal((batch, 1, G, N))
    y, gate = mx.random.normal((batch, 1, H * P)), mx.random.normal((batch, 1, H * P))
    conv_in = mx.random.normal((batch, 1, m.conv_dim))
    windows = [mx.zeros((batch, K - 1, m.conv_dim)) for _ in mixers]
    states = [mx.random.normal((batch, H, P, N)) * 0.01 for _ in mixers]
    mx.eval(x, xs, dt, Bm, Cm, y, gate, conv_in, *windows, *states)

    def timed(fn: Any) -> float:
        mx.eval(fn())
        t0 = time.perf_counter()
        for _ in range(iters):
            mx.eval(fn())
        return 1e3 * (time.perf_counter() - t0) / iters

    def conv() -> list[mx.array]:
        outs = []
        for mixer, w in zip(mixers, windows):
            padded = mx.concatenate([w, conv_in], axis=1)
            outs += [nn.silu(mixer.conv1d(padded)), padded[:, -(K - 1):, :]]
        return outs

    if hasattr(model, "lm_head"):
        head: Any = model.lm_head
    else:
        head = model.backbone.embeddings.as_linear
    h = mx.random.normal((batch, 1, hidden))
    mx.eval(h)
    with fused_ops():
        parts = {
            "ssm_update (mlx-lm)": timed(lambda: [t for mx_, st in zip(mixers, states) for t in ssm_update(
                xs, mx_.A_log, Bm, Cm, mx_.D, dt, mx_.dt_bias, st, mx_.time_step_limit)]),
            "ssm_update (engine)": timed(lambda: [t for mx_, st in zip(mixers, states) for t in engine_ssm(
                xs, mx_.A_log, Bm, Cm, mx_.D, dt, mx_.dt_bias, st, mx_.time_step_limit)]),
            "in_proj": timed(lambda: [mixer.in_proj(x) for mixer in mixers]),
            "conv1d": timed(conv),
            "norm + out_proj": timed(lambda: [mixer.out_proj(mixer.norm(y, gate)) for mixer in mixers]),
            "mlps": timed(lambda: [b.mixer(b.norm(x)) for b in mlps]) if mlps else 0.0,
            "lm_head": timed(lambda: head(h)),
        }
    return StepProfile(parts["ssm_update (mlx-lm)"] / 1e3, parts["ssm_update (engine)"] / 1e3, step,
                       "the engine's ssm_update"), parts


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

    family = args.hybrid_family
    if family == "qwen3_5":
        model, text = qwen35_model(args.hybrid_hidden, args.hybrid_layers, args.hybrid_interval, args.hybrid_vocab)
        shape = f"{args.hybrid_layers} layers (full attention every {args.hybrid_interval})"
    else:
        model, text = ssm_model(family, args.hybrid_hidden, args.hybrid_layers, args.hybrid_interval,
                                args.hybrid_vocab)
        m = _MAMBA
        shape = (f"blocks {nemotron_h_pattern(args.hybrid_layers, args.hybrid_interval)}" if family == "nemotron_h"
                 else f"{args.hybrid_layers} layers") + (
            f"; Mamba-2 {m['mamba_heads']} heads x {m['mamba_head_dim']}, state {m['state']}, {m['groups']} groups")
    lm = loaded(model, text)
    ext = cpu_ext.load()
    isa = f"{ext.SIMD}, {ext.num_threads()} threads" if ext is not None else "no CPU extension"
    n_params = sum(v.size for _, v in nn.utils.tree_flatten(model.parameters()))
    print(f"{family}-shaped, {n_params / 1e6:.0f}M params fp32 ({4 * n_params / 1e6:.0f} MB), {shape}; CPU kernels "
          f"{isa}; BLAS {BLAS.name}", flush=True)

    parts: dict[str, float] | None = None
    if family == "qwen3_5":
        prof = recurrent_share(model, lm, 16)
        alone, step = prof.mlx_lm_s, prof.step_s
        print(f"profile, batch-16 decode step: {1e3 * step:.1f} ms (the engine's recurrence: {prof.gated_delta}); "
              f"the delta-rule updates alone: mlx-lm's {1e3 * alone:.1f} ms, trillm's gated_delta "
              f"{1e3 * prof.trillm_s:.1f} ms ({100 * prof.trillm_s / step:.0f}% of the step)", flush=True)
    else:
        prof, parts = ssm_profile(model, lm, 16)
        alone, step = prof.trillm_s, prof.step_s
        listed = ", ".join(f"{k} {v:.1f} ms" for k, v in parts.items())
        print(f"profile, batch-16 decode step: {1e3 * step:.1f} ms; parts alone over their layers: {listed}; the "
              f"state-space update as the engine runs it {100 * alone / step:.0f}% of the step", flush=True)

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
                            (1e3 * prof.trillm_s, 1e3 * alone), prof.gated_delta, family, parts)
    if min(single, peer_single, prefill, peer_prefill, *(x for pair in batches.values() for x in pair)) <= 0 or \
            best_c[1] >= best_u[1] or not best_u[0] < float("inf"):
        raise SystemExit("bench engine --hybrid measured nothing (or the second turn never hit the prefix cache)")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-hybrid-{family}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(asdict(figures) | {"blas": BLAS.name, "max_tokens": args.max_tokens,
                                                  "prefill_tokens": args.prefill_tokens}, indent=2))
    print(f"wrote {path}")
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hybrid", action="store_true",
                    help="instead: a hybrid built in memory (bench/engine_hybrid.py; --hybrid-family)")
    ap.add_argument("--hybrid-family", choices=FAMILIES, default="qwen3_5",
                    help="--hybrid: qwen3_5 (gated delta + full attention), nemotron_h (Mamba-2 + full attention, "
                         "MLP blocks between) or mamba2 (Mamba-2 only)")
    ap.add_argument("--hybrid-hidden", type=int, default=1024, help="--hybrid: hidden size")
    ap.add_argument("--hybrid-layers", type=int, default=6, help="--hybrid: layers (nemotron_h: mixer blocks)")
    ap.add_argument("--hybrid-interval", type=int, default=3, help="--hybrid: a full-attention layer every N")
    ap.add_argument("--hybrid-vocab", type=int, default=49152, help="--hybrid: vocabulary (tied embeddings)")
