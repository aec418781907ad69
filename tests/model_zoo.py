"""Tiny random-weight model folders of every mlx-lm family the engine serves or refuses (the model matrix).

Each `Family` declares a config built from that family's mlx-lm `ModelArgs` with tiny dims, small sliding
windows (5 to 16 tokens) in patterns that mix sliding and full layers, and few experts, plus what the engine is
expected to do with it: "identical" (tokens and logprobs equal to mlx-lm's own generation) or "refused"
(an exception at load with a one-line message). `build(family, path)` writes safetensors + config.json + the
byte-level BPE tokenizer of tests/tiny_model.py; the output head is scaled until greedy choices have a clear
margin (checked on mlx-lm's own generation of the written folder), so comparisons are never coin tosses.

`supported_models_markdown()` renders docs/supported_models.md from the same declarations; regenerate it
with `python tests/model_zoo.py --write-docs` (tests/engine/test_model_matrix.py fails when it drifts).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS first)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from tiny_model import CHATML_TEMPLATE, train_tiny_tokenizer

WINDOW = 8  # the usual sliding window; others are 5, 12, 16 (below, equal to, across and past 8-token blocks)
SEEDS = 8  # weight seeds tried before the builder gives up on a margin
MARGIN = 0.05  # smallest top-1 minus top-2 logit gap accepted on the builder's probe (fp32 noise is ~1e-5)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "supported_models.md"
CHECKS = ("single", "batched (ragged)", "long prompt (across blocks and windows)",
          "staggered arrivals, chunked prefill mixed with decodes", "preemption", "abort mid-prefill",
          "prefix-cache hit (full and partial)", "prompt logprobs")


@dataclass(frozen=True)
class Family:
    name: str  # the matrix id (a family, or a family's RoPE variant)
    model_type: str  # config.json's model_type (mlx-lm picks the module by it)
    attention: str  # the attention kind, as the docs table shows it
    config: Mapping[str, Any]  # the config's own keys, over `_BASE` when `base`
    expect: str = "identical"  # "identical" to mlx-lm, or "refused" at load in one line
    base: bool = True
    windowed: bool = False  # has sliding-window layers (the matrix checks the window is exercised)
    window_key: str = "sliding_window"  # the config key of its window (Llama 4: attention_chunk_size)
    prefix_caching: bool = True  # a repeated prompt must hit the prefix cache (False: must not)
    notes: str = ""
    text_config: Mapping[str, Any] | None = field(default=None)  # nested text config (mistral3 wrapper)


# Shared by most families: mlx-lm ignores keys its ModelArgs does not declare.
_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rope_traditional": False,
    "tie_word_embeddings": False,
}

_SW_FULL = "sliding window + full"
_HYBRID = "hybrid"


def _alt(n: int, first: str = "sliding_attention", second: str = "full_attention") -> list[str]:
    return [first if i % 2 == 0 else second for i in range(n)]


FAMILIES: tuple[Family, ...] = (
    Family("llama", "llama", "full", {}),
    Family("llama3", "llama", "full (llama3 RoPE scaling)", {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        "tie_word_embeddings": True}),
    Family("qwen2", "qwen2", "full (QKV bias)", {"tie_word_embeddings": True}),
    Family("qwen3", "qwen3", "full (QK norm)", {}),
    Family("qwen3_moe", "qwen3_moe", "full (QK norm), MoE", {
        "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": 64, "norm_topk_prob": True}),
    Family("mistral3", "mistral3", "full", {}, base=False, text_config={"model_type": "mistral"}),
    Family("ministral3", "mistral3", _SW_FULL + " (llama4 attention scaling)", {}, base=False, windowed=True,
           text_config={
               "model_type": "ministral3", "num_hidden_layers": 4, "layer_types": _alt(4), "sliding_window": 12,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
                                   "original_max_position_embeddings": 16}}),
    Family("mixtral", "mixtral", "full, MoE", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    Family("gemma", "gemma", "full", {}),
    Family("gemma2", "gemma2", "full + attention and final logit soft-capping", {
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}),
    Family("gemma3_text", "gemma3_text", _SW_FULL, {
        "num_hidden_layers": 4, "sliding_window": 12, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0}, windowed=True),
    Family("gemma4_text", "gemma4_text", "per-layer head dim + KV sharing, " + _SW_FULL, {
        "num_hidden_layers": 4, "global_head_dim": 32, "num_kv_shared_layers": 2, "sliding_window": WINDOW,
        "sliding_window_pattern": 2, "hidden_size_per_layer_input": 16, "num_key_value_heads": 1,
        "final_logit_softcapping": 30.0, "use_double_wide_mlp": False, "tie_word_embeddings": True,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}, windowed=True),
    Family("gemma4_text_moe", "gemma4_text", "per-layer head dim + KV sharing + K=V full layers, " + _SW_FULL
           + ", MoE", {
        "num_hidden_layers": 4, "global_head_dim": 32, "num_kv_shared_layers": 2, "sliding_window": WINDOW,
        "sliding_window_pattern": 2, "hidden_size_per_layer_input": 16, "num_key_value_heads": 2,
        "attention_k_eq_v": True, "num_global_key_value_heads": 1, "enable_moe_block": True, "num_experts": 4,
        "top_k_experts": 2, "moe_intermediate_size": 32, "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": False, "tie_word_embeddings": True}, windowed=True),
    Family("phi3", "phi3", "full (fused QKV)", {"num_key_value_heads": 4}),
    Family("phi3_longrope", "phi3", "full (longrope)", {
        "num_key_value_heads": 4, "original_max_position_embeddings": 32,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [1.0 + 0.5 * i for i in range(8)]}}),
    Family("glm4", "glm4", "full (partial RoPE)", {"attention_bias": True, "partial_rotary_factor": 0.5}),
    Family("olmo2", "olmo2", "full (QK norm)", {}),
    Family("olmo3", "olmo3", _SW_FULL + " (QK norm)", {
        "num_hidden_layers": 4, "sliding_window": 12,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]},
        windowed=True),
    Family("smollm3", "smollm3", "full, no-RoPE layers", {"num_hidden_layers": 4, "no_rope_layer_interval": 2}),
    Family("starcoder2", "starcoder2", "full (biases, LayerNorm)", {"norm_epsilon": 1e-5, "tie_word_embeddings": True}),
    Family("internlm2", "internlm2", "full (fused wqkv)", {"bias": False}),
    Family("granite", "granite", "full, logit/embedding/residual multipliers", {
        "logits_scaling": 4.0, "attention_multiplier": 0.2, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
        "attention_bias": False, "mlp_bias": False}),
    Family("cohere2", "cohere2", _SW_FULL + " (no RoPE on full layers), logit scale", {
        "num_hidden_layers": 4, "layer_norm_eps": 1e-5, "logit_scale": 0.25, "sliding_window": 5,
        "sliding_window_pattern": 2}, windowed=True),
    Family("exaone4", "exaone4", _SW_FULL, {
        "num_hidden_layers": 4, "sliding_window": 16, "sliding_window_pattern": "LG", "layer_types": _alt(4),
        "rope_scaling": None},
        windowed=True),
    Family("gpt_oss", "gpt_oss", "sinks + sliding window + full, MoE", {
        "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
        "layer_types": _alt(4), "intermediate_size": 64}, windowed=True),
    Family("llama4_text", "llama4_text", "full, no-RoPE layers, QK norm, separate `output` head", {
        "num_hidden_layers": 4, "intermediate_size_mlp": 128, "no_rope_layers": [1, 0, 1, 0], "use_qk_norm": True}),
    Family("llama4", "llama4", "chunked attention (8-token chunks) + full no-RoPE layers, MoE", {}, base=False,
           windowed=True, window_key="attention_chunk_size", text_config={
               "model_type": "llama4_text", "num_hidden_layers": 4, "attention_bias": False,
               "attention_chunk_size": WINDOW, "interleave_moe_layer_step": 2, "intermediate_size_mlp": 128,
               "num_experts_per_tok": 1, "num_local_experts": 4, "rope_scaling": None, "use_qk_norm": True,
               "attn_temperature_tuning": True, "floor_scale": 16, "attn_scale": 0.1}),
    Family("deepseek_v3", "deepseek_v3", "MLA, MoE", {
        "moe_intermediate_size": 32, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "qk_nope_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 1.5}),
    Family("qwen2_moe", "qwen2_moe", "full (QKV bias), MoE with a shared expert", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64}),
    Family("olmoe", "olmoe", "full (QK norm), MoE", {"num_experts": 4, "num_experts_per_tok": 2}),
    Family("granitemoe", "granitemoe", "full, multipliers, MoE", {
        "logits_scaling": 4.0, "attention_multiplier": 0.2, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
        "attention_bias": False, "num_local_experts": 4, "num_experts_per_tok": 2}),
    Family("phimoe", "phimoe", "full, MoE", {"num_key_value_heads": 2, "num_local_experts": 4,
                                             "num_experts_per_tok": 2, "router_jitter_noise": 0.0}),
    Family("seed_oss", "seed_oss", "full", {}),
    Family("ernie4_5", "ernie4_5", "full", {"use_bias": False}),
    Family("hunyuan_v1_dense", "hunyuan_v1_dense", "full (QK norm)", {}),
    Family("glm4_moe_lite", "glm4_moe_lite", "MLA, MoE", {
        "moe_intermediate_size": 32, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "qk_nope_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.8, "rope_scaling": None}),
    Family("glm4_moe", "glm4_moe", "full (partial RoPE, QK norm), MoE", {
        "moe_intermediate_size": 32, "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "n_routed_experts": 4, "routed_scaling_factor": 1.5, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "rope_scaling": None, "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5}),
    Family("deepseek_v2", "deepseek_v2", "MLA, MoE", {
        "moe_intermediate_size": 32, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "qk_nope_head_dim": 16, "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    Family("minicpm3", "minicpm3", "MLA", {
        "num_key_value_heads": 4, "dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 4.0, "q_lora_rank": 48,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "kv_lora_rank": 32,
        "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 32,
                         "short_factor": [1.0 + 0.1 * i for i in range(4)],
                         "long_factor": [1.0 + 0.5 * i for i in range(4)]}}),
    # Hybrid recurrent families: recurrent state in the engine's state pool (engine/state_pool.py), attention
    # layers paged; prefix hits resume from recurrent-state checkpoints (engine/state_checkpoints.py).
    Family("qwen3_next", "qwen3_next", _HYBRID + ": gated delta + full", {
        "num_hidden_layers": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64, "mlp_only_layers": [],
        "moe_intermediate_size": 32, "partial_rotary_factor": 0.25, "full_attention_interval": 2}),
    Family("qwen3_5", "qwen3_5", _HYBRID + ": gated delta + full", {}, base=False, text_config={
        "model_type": "qwen3_5_text", "num_hidden_layers": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "rope_parameters": {"type": "default", "mrope_section": [1, 1, 0], "rope_theta": 100000,
                            "partial_rotary_factor": 0.25}}),
    Family("lfm2", "lfm2", _HYBRID + ": short conv + full", {
        "num_hidden_layers": 4, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
        "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 128, "full_attn_idxs": [1, 3]}),
    Family("nemotron_h", "nemotron_h", _HYBRID + ": mamba2 + full", {
        "num_hidden_layers": 4, "hybrid_override_pattern": "M*M-", "mamba_num_heads": 4, "mamba_head_dim": 16,
        "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False,
        "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True, "attention_bias": False}),
    Family("falcon_h1", "falcon_h1", _HYBRID + ": parallel mamba2 + attention", {
        "num_hidden_layers": 2, "mamba_d_conv": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16,
        "mamba_n_heads": 4, "mamba_chunk_size": 16, "tie_word_embeddings": True}),
    # No attention layer at all: recurrent state only, the KV pool empty (its blocks still count tokens for the
    # prefix cache's checkpoints).
    Family("mamba2", "mamba2", "state space only (mamba2)", {
        "num_heads": 8, "head_dim": 16, "intermediate_size": 128, "expand": 2, "state_size": 16, "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5, "conv_kernel": 4, "n_groups": 1, "use_bias": False, "use_conv_bias": True,
        "time_step_limit": [0.0, float("inf")], "time_step_rank": 8, "tie_word_embeddings": True}, base=False),
    # Recurrent families the matrix does not check are refused by name (Mamba-1 here).
    Family("mamba", "mamba", "state space only (Mamba-1; refused)", {
        "hidden_size": 64, "intermediate_size": 128, "state_size": 16, "num_hidden_layers": 2, "conv_kernel": 4,
        "use_bias": False, "use_conv_bias": True, "time_step_rank": 8, "tie_word_embeddings": True}, base=False,
        expect="refused"),
)
FAMILY = {f.name: f for f in FAMILIES}


# ---- building ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    return str(train_tiny_tokenizer(512).to_str())


def tokenizer_facts() -> tuple[int, int, int]:
    """(vocab size, bos id, eos id) of the shared tiny tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_tokenizer_json())
    return tok.get_vocab_size(), tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")


def family_config(family: Family) -> dict[str, Any]:
    """The config.json of `family`'s tiny model."""
    vocab, bos, eos = tokenizer_facts()
    common = {"vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}
    config: dict[str, Any] = {"model_type": family.model_type, **(_BASE if family.base else {}), **common}
    if family.model_type == "mamba2":
        config.update(hidden_size=64)
    config.update(copy.deepcopy(dict(family.config)))
    if family.text_config is not None:
        config["text_config"] = {**_BASE, **common, **copy.deepcopy(dict(family.text_config))}
    return config


def model_classes(config: dict[str, Any]) -> tuple[type[nn.Module], Any]:
    from mlx_lm.utils import _get_classes

    return _get_classes(config=config)  # type: ignore[no-any-return]


def mlx_lm_model(path: Path, overrides: Mapping[str, Any] | None = None) -> nn.Module:
    """mlx-lm's own model of a zoo folder, loaded the way `mlx_lm.load` does; `overrides` replace config keys
    (in the text config, when there is one) before the model is built."""
    from mlx_lm.utils import load_model

    if not overrides:
        return load_model(Path(path))[0]
    config = json.loads((Path(path) / "config.json").read_text())
    target = config.get("text_config", config)
    target.update(overrides)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = mx.load(str(Path(path) / "model.safetensors"))
    model.load_weights(list(model.sanitize(weights).items()) if hasattr(model, "sanitize") else list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model


def _head_key(params: Mapping[str, mx.array]) -> str:
    for suffix in ("lm_head.weight", "output.weight"):
        hits = [k for k in params if k == suffix or k.endswith("." + suffix)]
        if hits:
            return hits[0]
    for suffix in ("embed_tokens.weight", "tok_embeddings.weight", "embeddings.weight", "wte.weight"):
        hits = [k for k in params if k.endswith(suffix) and "per_layer" not in k]
        if hits:
            return hits[0]
    raise KeyError(f"no output head among {sorted(params)[:8]}...")


PROMPT_LENGTHS = {"short": 5, "medium": 12, "ragged": 23, "long": 57}  # long: 8 blocks of 8, 7 windows
BRANCH = 44  # "branch": the long prompt's first BRANCH tokens, then other ones (a partial prefix-cache hit)
NEW_TOKENS = 16  # generated per request in the matrix
_PROMPT_TEXT = ("Once upon a time, there was a small model that learned to count: 1, 2, 3, 4, 5. "
                "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b. Hello world! ")


@functools.lru_cache(maxsize=1)
def matrix_prompts() -> dict[str, tuple[int, ...]]:
    """The matrix's prompts, by name: distinct texts, cut to PROMPT_LENGTHS tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_tokenizer_json())
    ids = tok.encode(_PROMPT_TEXT * 4).ids
    out, start = {}, 0
    for name, n in PROMPT_LENGTHS.items():
        out[name] = tuple(ids[start : start + n])
        start += 7  # each prompt starts elsewhere, so no two share a prefix
    out["branch"] = out["long"][:BRANCH] + tuple(ids[100 : 100 + 9])
    return out


def greedy_margins(model: nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """mlx-lm's own greedy generation: the tokens, and each step's top-1 minus top-2 logprob."""
    from mlx_lm.generate import generate_step

    tokens, margins = [], []
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=n,
                                       sampler=lambda x: mx.argmax(x, axis=-1)):
        top2 = mx.topk(logprobs.reshape(-1), 2)
        tokens.append(int(tok))
        margins.append(abs(float(top2[1] - top2[0])))
    return tokens, margins


def _write_tokenizer(path: Path, max_len: int) -> None:
    (path / "tokenizer.json").write_text(_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False, "model_max_length": max_len,
    }, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))


def build(family: Family | str, path: Path, *, seed: int = 0, check_margin: bool = True) -> Path:
    """Write `family`'s tiny random model folder to `path`; loads with mlx_lm.load and trillm's load_model.

    The head (lm_head, `output`, or the tied embedding) is scaled up, and other seeds tried, until mlx-lm's
    own greedy generation of NEW_TOKENS on every matrix prompt keeps each top-1 ahead of the top-2 by MARGIN
    (ValueError if none does): the matrix's greedy comparisons are then never coin tosses.
    """
    fam = FAMILY[family] if isinstance(family, str) else family
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = family_config(fam)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(path, 1024)
    model_class, args_class = model_classes(config)
    best = 0.0
    for attempt_seed in range(seed, seed + SEEDS):
        mx.random.seed(attempt_seed)
        model = model_class(args_class.from_dict(config))
        model.eval()
        params = dict(tree_flatten(model.parameters()))
        for key in [k for k in params if k.endswith("sinks")]:  # zero-initialised sinks would test little
            params[key] = mx.random.normal(params[key].shape)
        head = _head_key(params)
        base_head = params[head]
        for scale in (8.0, 32.0, 96.0):
            params[head] = base_head * scale
            if check_margin:  # on the model in memory; the matrix checks it again on mlx_lm.load's
                model.update(tree_unflatten(list(params.items())))
                prompts = matrix_prompts().values()
                margin = min(m for p in prompts for m in greedy_margins(model, list(p), NEW_TOKENS)[1])
                best = max(best, margin)
                if margin < MARGIN:
                    continue
            mx.save_safetensors(str(path / "model.safetensors"), {k: v.astype(mx.float32) for k, v in params.items()})
            return path
    raise ValueError(f"{fam.name}: best top-1 margin {best:.4f} < {MARGIN} over {SEEDS} seeds")


# ---- the docs table ----------------------------------------------------------------------------------------
def supported_models_markdown() -> str:
    """docs/supported_models.md, from FAMILIES (what tests/engine/test_model_matrix.py asserts per family)."""
    lines = [
        "# Supported models",
        "",
        "<!-- generated by `python tests/model_zoo.py --write-docs` from tests/model_zoo.py; do not edit -->",
        "",
        "Each row is a family case of `tests/engine/test_model_matrix.py`: a tiny random-weight model built from",
        "mlx-lm's own `ModelArgs` (sliding windows of 5 to 16 tokens mixed with full layers, few experts), served by",
        "trillm's paged engine and compared with mlx-lm's own generation of the same folder (greedy, fp32, its own",
        "caches). A row that does not hold is a failing test, not a footnote.",
        "",
        "- **identical**: the greedy tokens, and their logprobs (chosen and top 3, within 1e-3 + 1e-4 x |logprob|),",
        "  match mlx-lm's in every check: " + "; ".join(CHECKS) + ".",
        "- **refused at load**: creating the engine raises `UnsupportedModel` with a one-line message naming the",
        "  model, never a traceback at request time.",
        "",
        "| family | model_type | attention | expected | checked | prefix caching |",
        "|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        ok = f.expect == "identical"
        checked = ("all checks" if f.prefix_caching else "all checks (a repeated prompt must not hit)") if ok else \
            "refused at load in one line"
        caching = "no" if not (ok and f.prefix_caching) else (
            "yes (resumes from recurrent-state checkpoints)" if f.attention.startswith((_HYBRID, "state space"))
            else "yes")
        lines.append(f"| {f.name} | `{f.model_type}` | {f.attention} | {'identical' if ok else 'refused at load'} | "
                     f"{checked} | {caching} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--write-docs", action="store_true", help=f"write {DOCS}")
    parser.add_argument("--build", metavar="FAMILY", help="build one family's folder (into --out)")
    parser.add_argument("--out", type=Path, default=Path("zoo"))
    args = parser.parse_args(argv)
    if args.write_docs:
        DOCS.parent.mkdir(parents=True, exist_ok=True)
        DOCS.write_text(supported_models_markdown())
        print(f"wrote {DOCS}")
    if args.build:
        print(build(args.build, args.out / args.build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
