"""GGUF architectures as mlx-lm models: the config each `<arch>.*` metadata set means, and the tensor names.

Written from what llama.cpp's convert_hf_to_gguf.py stores per family and what its loader (src/models/*.cpp)
assumes where a key is absent. Anything the mlx-lm class cannot represent is refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from trillm.engine.errors import CorruptModelFile

SUPPORTED_ARCHITECTURES = ("llama", "mistral3", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


# --- config -------------------------------------------------------------------------------------------


class _Meta:
    """`<arch>.*` metadata lookups that refuse what the model classes cannot represent, in one line."""

    def __init__(self, meta: dict[str, Any], arch: str, path: str) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if isinstance(value, list) and key != "attention.sliding_window_pattern":
            if not value or len(set(value)) != 1:  # per-layer values: the model classes need them uniform
                raise CorruptModelFile(f"{self.path}: per-layer {self.arch}.{key} {value[:4]}... is not supported")
            value = value[0]
        if value is None and required:
            raise CorruptModelFile(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    def refuse(self, what: str) -> CorruptModelFile:
        return CorruptModelFile(f"{self.path}: unsupported {self.arch} GGUF: {what}")


def _base_config(g: _Meta, weights: dict[str, mx.array], model_type: str) -> dict[str, Any]:
    heads = int(g.get("attention.head_count", required=True))
    hidden = int(g.get("embedding_length", required=True))
    head_dim = int(g.get("attention.key_length", hidden // heads))
    if int(g.get("attention.value_length", head_dim)) != head_dim:
        raise g.refuse("different key and value head sizes")
    rope_dims = g.get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim and g.arch != "phi3":
        raise g.refuse(f"partial RoPE ({rope_dims} of {head_dim} head dimensions)")
    layers = int(g.get("block_count", required=True))
    present = {int(m.group(1)) for k in weights if (m := _BLOCK.match(k))}
    if present != set(range(layers)):  # also keeps a corrupt count from building millions of layers
        raise CorruptModelFile(f"{g.path}: {g.arch}.block_count is {layers}, the file holds {len(present)} blocks")
    embed = weights.get("token_embd.weight")
    tokens = g.meta.get("tokenizer.ggml.tokens")
    vocab = embed.shape[0] if embed is not None else g.get("vocab_size") or len(tokens or ())
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(g.get("feed_forward_length", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(g.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g.get("rope.freq_base", 10000.0)),  # llama.cpp's default when the key is absent
        "max_position_embeddings": int(g.get("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in weights,
    }


def _rope_scaling(g: _Meta) -> dict[str, Any] | None:
    scaling = g.get("rope.scaling.type", "none")
    factor = float(g.get("rope.scaling.factor", 1.0) or 1.0)
    if scaling == "linear" and factor != 1.0:
        return {"type": "linear", "factor": factor}
    if scaling == "yarn":
        out: dict[str, Any] = {
            "type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(g.get("rope.scaling.original_context_length", 4096)),
        }
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if g.get(key) is not None:
                out[name] = float(g.get(key))
        return out
    if scaling not in ("none", "linear"):
        raise g.refuse(f"RoPE scaling {scaling!r}")
    return None


def _llama_config(g: _Meta, weights: dict[str, mx.array]) -> dict[str, Any]:
    config = _base_config(g, weights, "llama")
    config.update(
        attention_bias="blk.0.attn_q.bias" in weights,
        mlp_bias="blk.0.ffn_up.bias" in weights,
        # llama-arch GGUFs store Q/K rows permuted for interleaved (GPT-J style) RoPE.
        rope_traditional=True,
    )
    if (scaling := _rope_scaling(g)) is not None:
        config["rope_scaling"] = scaling
    return config


def _mistral3_config(g: _Meta, weights: dict[str, mx.array]) -> dict[str, Any]:
    """Mistral Small 3.x text is llama-shaped (llama.cpp runs MISTRAL3 as llama, Q/K permuted). Ministral 3
    adds YaRN and Llama-4 style attention temperature scaling: mlx-lm's ministral3 class, whose half-split
    RoPE needs the Q/K rows un-permuted (see unpermute_qk)."""
    beta = g.get("attention.temperature_scale")
    if beta is None:
        return _llama_config(g, weights)
    config = _base_config(g, weights, "ministral3")
    scaling = _rope_scaling(g)
    if scaling is None or scaling["type"] != "yarn":
        raise g.refuse("attention temperature scaling without YaRN")
    if any(float(g.get(f"rope.scaling.yarn_{k}_factor", 1.0)) != 1.0 for k in ("ext", "attn")):
        raise g.refuse("YaRN extrapolation or attention factors other than 1")
    if int(g.get("attention.sliding_window", 0) or 0):
        raise g.refuse("sliding windows")
    if any(k in weights for k in ("blk.0.attn_q.bias", "blk.0.attn_output.bias", "rope_freqs.weight")):
        raise g.refuse("biases or RoPE frequency factors")
    config["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": config["rope_theta"],
        "factor": scaling["factor"],
        "original_max_position_embeddings": scaling["original_max_position_embeddings"],
        "beta_fast": scaling.get("beta_fast", 32.0),  # llama.cpp's defaults
        "beta_slow": scaling.get("beta_slow", 1.0),
        # llama.cpp (llama-context.cpp) takes mscale as 1 and mscale_all_dim from yarn_log_multiplier.
        "mscale": 1.0,
        "mscale_all_dim": float(g.get("rope.scaling.yarn_log_multiplier", 0.0)),
        "llama_4_scaling_beta": float(beta),
    }
    return config


# mlx-lm classes with half-split RoPE that llama-arch files (Q/K rows permuted) are loaded into.
_UNPERMUTE_FOR = ("ministral3",)


def unpermute_qk(weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """Undo convert_hf_to_gguf's LlamaModel.permute on q_proj/k_proj rows (and their quantization scales),
    for the classes in _UNPERMUTE_FOR; other configs are returned unchanged."""
    if config["model_type"] not in _UNPERMUTE_FOR:
        return weights
    out = dict(weights)
    for key, value in weights.items():
        part = key.rsplit(".", 2)[-2] if key.count(".") >= 2 else ""
        if part not in ("q_proj", "k_proj") or ".self_attn." not in key:
            continue
        n = config["num_attention_heads" if part == "q_proj" else "num_key_value_heads"]
        rows = value.shape[0]
        out[key] = value.reshape(n, rows // n // 2, 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
    return out


def _qwen_config(g: _Meta, weights: dict[str, mx.array]) -> dict[str, Any]:
    config = _base_config(g, weights, g.arch)
    if g.arch == "qwen2":
        if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
            raise g.refuse("head size other than embedding_length / head_count")
        if "blk.0.attn_q.bias" not in weights:
            raise g.refuse("no Q/K/V biases (the qwen2 class always has them)")
    if (scaling := _rope_scaling(g)) is not None:
        config["rope_scaling"] = scaling
    return config


def _query_pre_attn_scalar(g: _Meta, config: dict[str, Any]) -> int:
    # GGUF has no key for it: llama.cpp (after gemma_pytorch) uses hidden/heads for the 27B models
    # (46 layers for Gemma 2, 62 for Gemma 3) and the head size otherwise.
    big = config["num_hidden_layers"] == (46 if g.arch == "gemma2" else 62)
    return int(config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"])


def _gemma2_config(g: _Meta, weights: dict[str, mx.array]) -> dict[str, Any]:
    config = _base_config(g, weights, "gemma2")
    window = int(g.get("attention.sliding_window", 4096))  # llama.cpp's Gemma 2 default
    config.update(
        tie_word_embeddings=True,  # llama.cpp always uses token_embd as the output for Gemma 2
        rms_norm_eps=float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        attn_logit_softcapping=float(g.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(g.get("final_logit_softcapping", 30.0)),
        query_pre_attn_scalar=_query_pre_attn_scalar(g, config),
        sliding_window=window,
        # Even layers slide, as in HF's Gemma 2 and llama.cpp's set_swa_pattern(2).
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config["num_hidden_layers"])
        ],
    )
    if config["attn_logit_softcapping"] <= 0 or config["final_logit_softcapping"] <= 0:
        raise g.refuse("soft-capping disabled (the gemma2 class always caps)")
    if g.get("rope.freq_base_swa") not in (None, config["rope_theta"]):
        raise g.refuse("a separate RoPE base for sliding layers")
    if _rope_scaling(g) is not None:
        raise g.refuse("RoPE scaling")
    return config


def _swa_pattern(g: _Meta, layers: int, default: int) -> int:
    """The period p of llama.cpp's pattern (layer i slides unless i % p == p - 1) that the file describes."""
    pattern = g.get("attention.sliding_window_pattern", default)
    if not isinstance(pattern, list):
        return int(pattern)
    flags = [bool(x) for x in pattern][:layers]
    for p in range(1, layers + 1):
        if flags == [i % p < p - 1 for i in range(layers)]:
            return p
    raise g.refuse(f"sliding-window layer pattern {flags} is not periodic")


def _gemma3_config(g: _Meta, weights: dict[str, mx.array]) -> dict[str, Any]:
    config = _base_config(g, weights, "gemma3_text")
    window = int(g.get("attention.sliding_window", 0) or 0)
    layers = config["num_hidden_layers"]
    pattern = _swa_pattern(g, layers, 6) if window > 0 else 1  # pattern 1: every layer global
    config.update(
        rms_norm_eps=float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_local_base_freq=float(g.get("rope.freq_base_swa", 10000.0)),  # llama.cpp's default
        query_pre_attn_scalar=_query_pre_attn_scalar(g, config),
        sliding_window=window if window > 0 else config["max_position_embeddings"],
        sliding_window_pattern=pattern,
        layer_types=["full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(layers)],
    )
    if float(g.get("final_logit_softcapping", 0.0) or 0.0) != 0.0:
        raise g.refuse("final logit soft-capping (the gemma3_text class has none)")
    if (scaling := _rope_scaling(g)) is not None:
        if scaling["type"] != "linear":
            raise g.refuse(f"RoPE scaling {scaling['type']!r}")
        config["rope_scaling"] = scaling  # applied to the global layers only, as in HF and llama.cpp
    return config


def _phi3_config(g: _Meta, weights: dict[str, mx.array]) -> dict[str, Any]:
    config = _base_config(g, weights, "phi3")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if config["head_dim"] * heads != hidden:
        raise g.refuse("head size other than embedding_length / head_count")
    rope_dims = int(g.get("rope.dimension_count", config["head_dim"]))
    config.update(
        partial_rotary_factor=rope_dims / config["head_dim"],
        original_max_position_embeddings=int(
            g.get("rope.scaling.original_context_length", config["max_position_embeddings"])
        ),
    )
    if window := int(g.get("attention.sliding_window", 0) or 0):  # 0 marks "none" (Phi-4)
        config["sliding_window"] = window
    long, short = weights.get("rope_factors_long.weight"), weights.get("rope_factors_short.weight")
    if long is not None and short is not None:
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": long.astype(mx.float32).tolist(),
            "short_factor": short.astype(mx.float32).tolist(),
        }
    elif long is not None or short is not None:
        raise g.refuse("only one of rope_factors_long / rope_factors_short")
    elif (scaling := _rope_scaling(g)) is not None:
        if scaling["type"] != "linear":
            raise g.refuse(f"RoPE scaling {scaling['type']!r}")
        config["rope_scaling"] = scaling
    return config


_CONFIGS: dict[str, Callable[[_Meta, dict[str, mx.array]], dict[str, Any]]] = {
    "llama": _llama_config,
    "mistral3": _mistral3_config,
    "qwen2": _qwen_config,
    "qwen3": _qwen_config,
    "gemma2": _gemma2_config,
    "gemma3": _gemma3_config,
    "phi3": _phi3_config,
}


def gguf_model_config(meta: dict[str, Any], weights: dict[str, mx.array], path: str = "") -> dict[str, Any]:
    """An mlx-lm config dict (HF key names; model_type names the mlx-lm module) from the `<arch>.*` metadata."""
    arch = meta.get("general.architecture")
    if arch not in _CONFIGS:
        raise CorruptModelFile(f"{path}: unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHITECTURES})")
    return _CONFIGS[arch](_Meta(meta, str(arch), path), weights)


# --- weights ------------------------------------------------------------------------------------------

_ATTN = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma 2/3's four norms per layer, as llama.cpp names them (gguf tensor_mapping: ATTN_POST_NORM, FFN_NORM,
# FFN_POST_NORM).
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps HF's fused projections: attn_qkv is qkv_proj, and ffn_up is gate_up_proj (gate rows first).
_PHI3 = {
    **_ATTN, "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj", **_LLAMA_NORMS,
}
_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": {**_ATTN, **_MLP, **_LLAMA_NORMS},
    "qwen2": {**_ATTN, **_MLP, **_LLAMA_NORMS},
    "qwen3": {**_ATTN, **_MLP, **_LLAMA_NORMS, **_QK_NORM},
    "gemma2": {**_ATTN, **_MLP, **_GEMMA_NORMS},
    "gemma3": {**_ATTN, **_MLP, **_GEMMA_NORMS, **_QK_NORM},
    "phi3": _PHI3,
}
_LAYER_NAMES["mistral3"] = _LAYER_NAMES["llama"]
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Top-level tensors that configure the model instead of holding weights, per architecture.
_CONFIG_TENSORS = {
    "llama": ("rope_freqs",), "mistral3": ("rope_freqs",), "phi3": ("rope_factors_long", "rope_factors_short"),
}
_NORM_SHIFTED = ("gemma2", "gemma3")  # the converter stores Gemma's RMSNorm weights as 1 + w
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)$")


def gguf_to_mlx_names(
    weights: dict[str, mx.array], path: str = "", arch: str = "llama"
) -> tuple[dict[str, mx.array], mx.array | None]:
    """Rename GGUF tensors to mlx-lm names for `arch` (undoing the converter's per-family changes).
    Returns (weights, llama-3 rope_freqs factors or None)."""
    out: dict[str, mx.array] = {}
    rope_freqs = None
    layer_names = _LAYER_NAMES[arch]
    for name, value in weights.items():
        m = _NAME.match(name)
        if m and m.group(1) is None and m.group(2) in _CONFIG_TENSORS.get(arch, ()):
            if m.group(2) == "rope_freqs":
                rope_freqs = value
            continue  # the others went into the config
        table = layer_names if m and m.group(1) is not None else _TOP_NAMES
        if m is None or m.group(2) not in table:
            raise CorruptModelFile(f"{path}: unexpected tensor {name!r} for a {arch} GGUF")
        layer, base, suffix = m.groups()
        if arch == "gemma2" and base == "output":
            continue  # llama.cpp ignores it too: Gemma 2's head is always the embedding
        if arch in _NORM_SHIFTED and base.endswith("norm") and suffix == "weight":
            value = value.astype(mx.float32) - 1.0  # exact in fp32 for every stored 1 + w >= 0.5
        prefix = f"model.layers.{layer}.{table[base]}" if layer is not None else table[base]
        out[f"{prefix}.{suffix}"] = value
    if arch == "phi3":
        _fuse_phi3_qkv(out)
    return out, rope_freqs


def _fuse_phi3_qkv(weights: dict[str, mx.array]) -> None:
    """A Phi-3 file with separate attn_q/k/v (llama.cpp accepts both) becomes the class's fused qkv_proj."""
    for key in [k for k in weights if ".self_attn.q_proj." in k]:
        parts = [weights.pop(key.replace(".q_proj.", f".{p}_proj.")) for p in "qkv"]
        weights[key.replace(".q_proj.", ".qkv_proj.")] = mx.concatenate(parts, axis=0)
