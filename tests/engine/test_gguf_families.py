"""GGUF beyond llama: qwen2, qwen3, mistral, gemma 2/3 and phi3 files, and the K-quants, against the folder.

Each family is a tiny random-weight HF/MLX folder (every weight random, norms included, so a swapped mapping
shows), converted the way llama.cpp's convert_hf_to_gguf.py does: its tensor names (from the gguf package's
own tensor map), Q/K rows permuted for llama-arch files only, Gemma's norms stored as 1 + w, Gemma's
untied head dropped, Phi-3's fused qkv/gate_up kept, and its metadata keys. trillm's GGUF loader must give
the folder's weights (max |diff| 0 in F32) and the logits mlx-lm computes from the folder.

K-quant blocks are built directly (random, with sane scales) and checked against a per-block transcription
of ggml-quants.c's dequantize_row_q4_K / q5_K / q6_K written here, independent of the gguf package.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten

from tiny_model import CHATML_TEMPLATE, train_tiny_tokenizer
from trillm.engine.errors import CorruptModelFile
from trillm.engine.gguf import TensorInfo, load_gguf, read_gguf, read_tensor
from trillm.engine.loader import load_model

PROMPT = "Hello world! The quick brown fox, 1969: def add(a, b): return a + b. Café 東京 😀 and more words here."

# --- tiny folders -----------------------------------------------------------------------------------------

_BASE = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}
# family -> (GGUF architecture, folder config on top of _BASE)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"model_type": "llama", "tie_word_embeddings": False}),
    "mistral": ("llama", {"model_type": "mistral", "rope_theta": 1e6, "tie_word_embeddings": False}),
    # Mistral Small 3.x text: llama-shaped, architecture "mistral3" in GGUF.
    "mistral3": ("mistral3", {"model_type": "mistral", "rope_theta": 1e6, "tie_word_embeddings": True}),
    # Ministral 3: YaRN plus Llama-4 attention temperature scaling past original_max_position_embeddings
    # (16 here, so the prompts cross it); mscale_all_dim != mscale so the YaRN attention factor matters.
    "ministral3": ("mistral3", {
        "model_type": "ministral3", "rope_theta": 1e6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                            "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.1},
    }),
    "qwen2": ("qwen2", {"model_type": "qwen2", "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    # head_dim 32 with 4 heads of a 64-wide model: q_proj is 128 rows, so head_dim must come from the file.
    "qwen3": ("qwen3", {"model_type": "qwen3", "head_dim": 32, "rope_theta": 1e6, "tie_word_embeddings": False}),
    "gemma2": ("gemma2", {
        "model_type": "gemma2", "head_dim": 32, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 20.0, "final_logit_softcapping": 5.0, "sliding_window": 4096,
        "num_hidden_layers": 4,
    }),
    "gemma3": ("gemma3", {
        "model_type": "gemma3_text", "num_hidden_layers": 6, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 16,
        "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window": 8, "sliding_window_pattern": 6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }),
    # A layer_types-style Gemma 3 whose pattern the converter writes as a per-layer bool array.
    "gemma3-pattern2": ("gemma3", {
        "model_type": "gemma3_text", "num_hidden_layers": 4, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 16,
        "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window": 8, "sliding_window_pattern": 2,
    }),
    "phi3": ("phi3", {
        "model_type": "phi3", "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    }),
    # Phi-3.5 / Phi-4-mini style: LongRoPE factors (as tensors in GGUF) and a partial rotary dimension.
    "phi3-longrope": ("phi3", {
        "model_type": "phi3", "tie_word_embeddings": True, "max_position_embeddings": 8192,
        "original_max_position_embeddings": 2048, "partial_rotary_factor": 0.75,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                         "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5]},
    }),
}
_GEMMA = ("gemma2", "gemma3")
_PERMUTED = ("llama", "mistral3")  # llama.cpp's LlamaModel.permute; every other family uses NEOX RoPE


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tiny_tokenizer(512).save(str(path))
    return path


def _exact(values: np.ndarray, bits: int = 12) -> np.ndarray:
    # Multiples of 2^-bits: 1 + w is exact in fp32, so Gemma's stored 1 + w gives back w bit for bit.
    return (np.round(values * (1 << bits)) / (1 << bits)).astype(np.float32)


def build_folder(
    path: Path, config: dict[str, Any], tokenizer_json: Path, *, seed: int = 0,
    overrides: dict[str, np.ndarray] | None = None,
) -> Path:
    """A random-weight mlx-lm folder of `config`'s family: every parameter random, norms included."""
    import importlib

    path.mkdir(parents=True, exist_ok=True)
    spec = json.loads(tokenizer_json.read_text())
    vocab = len(spec["model"]["vocab"]) + sum(t["id"] >= len(spec["model"]["vocab"]) for t in spec["added_tokens"])
    config = {**config, "vocab_size": vocab, "torch_dtype": "float32"}
    module_name = "llama" if config["model_type"] == "mistral" else config["model_type"]  # as mlx-lm remaps it
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    gemma = config["model_type"].startswith("gemma")
    for name, value in tree_flatten(model.parameters()):
        shape = tuple(value.shape)
        if name.endswith("norm.weight"):
            params[name] = _exact(rng.normal(0 if gemma else 1, 0.2, shape))
        else:
            params[name] = rng.normal(0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float32)
    if config["model_type"] == "gemma3_text":
        params.pop("lm_head.weight")  # Gemma 3 ties its head: no lm_head in its checkpoints
    # Clear margins between the top logits. A tied head also feeds the input: spread more, it would only
    # echo the last token.
    if "lm_head.weight" in params:
        params["lm_head.weight"] = params["lm_head.weight"] * 4.0
    elif gemma:  # Gemma multiplies its input embedding by sqrt(hidden_size)
        params["model.embed_tokens.weight"] = params["model.embed_tokens.weight"] * 0.25
    params.update(overrides or {})
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in params.items()})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(tokenizer_json.read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False,
    }))
    return path


# --- conversion, as convert_hf_to_gguf.py does it ---------------------------------------------------------

_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA, "mistral3": gguf.MODEL_ARCH.MISTRAL3, "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rows of each head from half-split to interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(w: gguf.GGUFWriter, arch: str, c: dict[str, Any], tokenizer_json: Path, name: str) -> None:
    w.add_name(name)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch != "phi3":
        w.add_rope_freq_base(c["rope_theta"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if arch in _PERMUTED:
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(c["head_dim"])
    if (rope := c.get("rope_parameters")) and "llama_4_scaling_beta" in rope:  # Mistral3Model.Ministral3Model
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
    if arch == "gemma3":
        w.add_sliding_window(c["sliding_window"])
        if c["sliding_window_pattern"] != 6:  # layer_types configs: the converter writes the per-layer flags
            p = c["sliding_window_pattern"]
            w.add_sliding_window_pattern([i % p < p - 1 for i in range(c["num_hidden_layers"])])
        if scaling := c.get("rope_scaling"):
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(scaling["factor"])
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
        rot = c.get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(rot * c["hidden_size"]) // c["num_attention_heads"])
        w.add_rope_freq_base(c["rope_theta"])
        w.add_sliding_window(0)
    spec = json.loads(tokenizer_json.read_text())
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_chat_template(CHATML_TEMPLATE)


TypeFor = Callable[[str, np.ndarray], "Q | tuple[Q, np.ndarray]"]


def to_gguf(
    folder: Path, out: Path, arch: str, tokenizer_json: Path, type_for: TypeFor | None = None, *,
    split_qkv: bool = False,
) -> Path:
    """Convert `folder` to GGUF. type_for(gguf_name, hf_value) picks each tensor's type (F32 by default), or
    returns (type, raw blocks) for blocks built by the caller (rows in HF order; permuted here if needed).
    split_qkv: write Phi-3's fused qkv_proj as separate attn_q/k/v, which llama.cpp also accepts."""
    c = json.loads((folder / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    if split_qkv:
        for name in [k for k in weights if k.endswith("qkv_proj.weight")]:
            q_rows, kv_rows = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
            q, k, v = np.split(weights.pop(name), [q_rows, q_rows + kv_rows])
            for part, value in zip("qkv", (q, k, v)):
                weights[name.replace("qkv_proj", f"{part}_proj")] = value
    tmap = gguf.get_tensor_name_map(_ARCH[arch], c["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), arch)
    _write_metadata(w, arch, c, tokenizer_json, folder.name)
    for name, value in weights.items():
        if arch in ("gemma2", "gemma3") and name == "lm_head.weight":
            continue  # GemmaModel.filter_tensors: "lm_head is not used in llama.cpp"
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            value = value + np.float32(1)  # Gemma(2|3)Model.modify_tensors
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        chosen = type_for(new, value) if type_for else Q.F32
        qtype, blocks = chosen if isinstance(chosen, tuple) else (chosen, None)
        heads = {".attn_q.": c["num_attention_heads"], ".attn_k.": c["num_key_value_heads"]}
        n_head = next((n for k, n in heads.items() if k in new), None)
        if arch in _PERMUTED and n_head is not None:
            value = permute(value, n_head)
            blocks = permute(blocks, n_head) if blocks is not None else None
        if blocks is not None:
            w.add_tensor(new, blocks, raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(new, value)
        elif qtype == Q.F16:
            w.add_tensor(new, value.astype(np.float16))
        else:
            w.add_tensor(new, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    if arch == "phi3" and (scaling := c.get("rope_scaling")):  # Phi3MiniModel.generate_extra_tensors
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# --- comparing ----------------------------------------------------------------------------------------------


def _folder_model(folder: Path) -> Any:
    from mlx_lm.utils import load_model as mlx_load_model

    model, _ = mlx_load_model(folder)
    return model


def _params(model: Any) -> dict[str, mx.array]:
    out = dict(tree_flatten(model.parameters()))
    return {k.removeprefix("language_model."): v for k, v in out.items()}


def assert_same_weights(gguf_model: Any, folder_model: Any, config: dict[str, Any], arch: str) -> None:
    got, want = _params(gguf_model), _params(folder_model)
    assert set(got) == set(want)
    for key, value in want.items():
        value = np.array(value)
        unpermuted = type(gguf_model).__module__.endswith("ministral3")  # half-split RoPE: rows un-permuted
        if arch in _PERMUTED and not unpermuted and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in key else "num_key_value_heads"]
            value = permute(value, heads)  # the loader keeps llama.cpp's layout and RoPEs interleaved
        assert got[key].shape == value.shape, key
        assert float(np.max(np.abs(np.array(got[key]) - value))) == 0.0, key


def _logits(model: Any, ids: list[int]) -> mx.array:
    out = model(mx.array([ids]))[0]
    mx.eval(out)
    return out


# --- every family, F32 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_f32_gguf_equals_folder(family: str, tokenizer_json: Path, tmp_path: Path) -> None:
    arch, extra = FAMILIES[family]
    config = {**_BASE, **extra}
    folder = build_folder(tmp_path / f"tiny-{family}", config, tokenizer_json)
    path = to_gguf(folder, tmp_path / f"tiny-{family}.F32.gguf", arch, tokenizer_json)
    config = json.loads((folder / "config.json").read_text())
    ref = _folder_model(folder)
    g = load_gguf(path, dtype=mx.float32)

    assert type(g.model).__module__ == type(ref).__module__ or family == "mistral3"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "rope_theta", "head_dim", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "sliding_window", "sliding_window_pattern", "rope_local_base_freq",
                "partial_rotary_factor", "original_max_position_embeddings", "max_position_embeddings"):
        if getattr(ref.args, key, None) is not None:
            assert getattr(g.model.args, key) == pytest.approx(getattr(ref.args, key)), key
    if hasattr(ref.args, "tie_word_embeddings"):
        assert g.model.args.tie_word_embeddings == ref.args.tie_word_embeddings
    assert_same_weights(g.model, ref, config, arch)

    ids = g.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * config.get("sliding_window", 0) or config.get("sliding_window", 0) > 100  # windows bite
    got, want = _logits(g.model, ids), _logits(ref, ids)
    if arch in _PERMUTED:  # interleaved RoPE on permuted rows vs half-split on the originals: same math
        assert mx.allclose(got, want, atol=1e-4).item()
    else:  # same class, same weights: the same computation
        assert mx.array_equal(got, want).item()
    assert (mx.argmax(got, axis=-1) == mx.argmax(want, axis=-1)).all().item()


def test_loaded_model_facts_per_family(tokenizer_json: Path, tmp_path: Path) -> None:
    """load_model's LoadedModel reads the GGUF config as it reads the folder's (heads, head size, layers)."""
    for family in ("qwen3", "gemma2", "phi3"):
        arch, extra = FAMILIES[family]
        folder = build_folder(tmp_path / f"tiny-{family}", {**_BASE, **extra}, tokenizer_json)
        g = load_model(str(to_gguf(folder, tmp_path / f"tiny-{family}.F32.gguf", arch, tokenizer_json)))
        f = load_model(str(folder))
        assert g.name == f"tiny-{family}"
        for field in ("num_layers", "num_kv_heads", "head_dim", "num_attention_heads", "max_model_len"):
            assert getattr(g, field) == getattr(f, field), (family, field)
        assert g.eos_token_ids == f.eos_token_ids
        text = "Hello world 12345 東京 😀  x\n\n  y <|im_start|>user\nHi<|im_end|>"
        assert g.tokenizer.encode(text) == f.tokenizer.encode(text)


# --- K-quants: an independent per-block reference, transcribed from ggml-quants.c -----------------------------


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[:, 0]


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4(j, scales, &d, &m)."""
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4), (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)


def ref_dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q4_K: block_q4_K = {half d; half dmin; u8 scales[12]; u8 qs[128]}."""
    d, dmin, scales, qs = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), blocks[:, 4:16], blocks[:, 16:144]
    y = np.empty((blocks.shape[0], 256), np.float32)
    for j in range(4):  # for (j = 0; j < QK_K; j += 64), is = 2j, q += 32
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * sc.astype(np.float32), dmin * m.astype(np.float32)
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * sc.astype(np.float32), dmin * m.astype(np.float32)
        q = qs[:, 32 * j : 32 * j + 32]
        y[:, 64 * j : 64 * j + 32] = d1[:, None] * (q & 0xF).astype(np.float32) - m1[:, None]
        y[:, 64 * j + 32 : 64 * j + 64] = d2[:, None] * (q >> 4).astype(np.float32) - m2[:, None]
    return y


def ref_dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q5_K: block_q5_K = {half d; half dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}."""
    d, dmin, scales = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), blocks[:, 4:16]
    qh, ql = blocks[:, 16:48], blocks[:, 48:176]
    y = np.empty((blocks.shape[0], 256), np.float32)
    for j in range(4):
        u1, u2 = 1 << (2 * j), 2 << (2 * j)
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * sc.astype(np.float32), dmin * m.astype(np.float32)
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * sc.astype(np.float32), dmin * m.astype(np.float32)
        q = ql[:, 32 * j : 32 * j + 32]
        lo = (q & 0xF) + np.where(qh & u1, 16, 0)
        hi = (q >> 4) + np.where(qh & u2, 16, 0)
        y[:, 64 * j : 64 * j + 32] = d1[:, None] * lo.astype(np.float32) - m1[:, None]
        y[:, 64 * j + 32 : 64 * j + 64] = d2[:, None] * hi.astype(np.float32) - m2[:, None]
    return y


def ref_dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q6_K: block_q6_K = {u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}."""
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc_all, d = blocks[:, 192:208].view(np.int8), _f16(blocks[:, 208:210])
    y = np.empty((blocks.shape[0], 256), np.float32)
    for n in range(2):  # for (n = 0; n < QK_K; n += 128): ql += 64, qh += 32, sc += 8
        l_ = ql[:, 64 * n : 64 * n + 64].astype(np.int16)
        h_ = qh[:, 32 * n : 32 * n + 32].astype(np.int16)
        sc = sc_all[:, 8 * n :]
        is_ = np.arange(32) // 16
        q1 = ((l_[:, :32] & 0xF) | (((h_ >> 0) & 3) << 4)) - 32
        q2 = ((l_[:, 32:] & 0xF) | (((h_ >> 2) & 3) << 4)) - 32
        q3 = ((l_[:, :32] >> 4) | (((h_ >> 4) & 3) << 4)) - 32
        q4 = ((l_[:, 32:] >> 4) | (((h_ >> 6) & 3) << 4)) - 32
        for k, q in enumerate((q1, q2, q3, q4)):  # y[l + 32k] = d * sc[is + 2k] * qk
            scale = d[:, None] * sc[:, is_ + 2 * k].astype(np.float32)
            y[:, 128 * n + 32 * k : 128 * n + 32 * k + 32] = scale * q.astype(np.float32)
    return y


REFERENCE = {Q.Q4_K: ref_dequantize_q4_k, Q.Q5_K: ref_dequantize_q5_k, Q.Q6_K: ref_dequantize_q6_k}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """Valid random blocks whose values are about `scale` in size and centred: random bits everywhere, then
    fp16 super-block scales sized so d * sc * q and dmin * m balance."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    nb = blocks.shape[0]
    u = rng.uniform(0.5, 1.5, nb)
    if qtype == Q.Q6_K:  # |sc| <= 128, |q| <= 32
        blocks[:, 208:210] = (u * scale / 2048).astype(np.float16).view(np.uint8).reshape(nb, 2)
    else:  # sc, m < 64; q < 16 (Q4_K) or < 32 (Q5_K): dmin * m ~ d * sc * q_mid
        qmax = 15 if qtype == Q.Q4_K else 31
        d = u * scale / (32 * qmax)
        blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
        blocks[:, 2:4] = (d * qmax / 2 * rng.uniform(0.8, 1.2, nb)).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_kquant_dequantization_matches_ggml_reference(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 512
    blocks = random_blocks(qtype, rows, cols, rng)
    want = REFERENCE[qtype](blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])).reshape(rows, cols)
    assert np.isfinite(want).all() and 0.005 < float(np.std(want)) < 0.5
    assert np.array_equal(gguf.quants.dequantize(blocks, qtype), want)  # the gguf package agrees
    info = TensorInfo("blk.0.ffn_up.weight", (rows, cols), int(qtype), 0, blocks.nbytes)
    got = read_tensor(blocks.reshape(-1), info)  # the loader's path
    if qtype in (Q.Q4_K, Q.Q5_K):  # held as an MLX affine triple (4 or 5 bits, groups of 32): must be exact
        assert set(got) == {"blk.0.ffn_up.weight", "blk.0.ffn_up.scales", "blk.0.ffn_up.biases"}
        bits = 4 if qtype == Q.Q4_K else 5
        assert got["blk.0.ffn_up.weight"].shape == (rows, cols * bits // 32)
        dense = mx.dequantize(got["blk.0.ffn_up.weight"], got["blk.0.ffn_up.scales"], got["blk.0.ffn_up.biases"],
                              group_size=32, bits=bits)
    else:  # dequantized at load by gguf.quants
        assert set(got) == {"blk.0.ffn_up.weight"}
        dense = got["blk.0.ffn_up.weight"]
    assert dense.dtype == mx.float32 and np.array_equal(np.array(dense), want)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_legacy_quants_repack_bit_exactly(qtype: Q, tmp_path: Path) -> None:
    """Q4_0/Q4_1/Q8_0 become MLX affine triples identical to mx.load's own GGUF reader, and dequantize to
    exactly what llama.cpp's reference (gguf.quants) gives."""
    rng = np.random.default_rng(int(qtype))
    values = rng.normal(0, 0.1, (24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mine, _ = read_gguf(tmp_path / "q.gguf")
    theirs = mx.load(str(tmp_path / "q.gguf"))
    assert set(mine) == set(theirs) == {"blk.0.ffn_up.weight", "blk.0.ffn_up.scales", "blk.0.ffn_up.biases"}
    for key in mine:
        assert mine[key].dtype == theirs[key].dtype and mx.array_equal(mine[key], theirs[key]).item(), key
    deq = mx.dequantize(mine["blk.0.ffn_up.weight"], mine["blk.0.ffn_up.scales"].astype(mx.float32),
                        mine["blk.0.ffn_up.biases"].astype(mx.float32), group_size=32,
                        bits=8 if qtype == Q.Q8_0 else 4)
    assert np.array_equal(np.array(deq), gguf.quants.dequantize(raw, qtype))


# --- a Q4_K_M / Q5_K_M style file against the same model's folder ---------------------------------------------

_KQ_BASE = {**_BASE, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}  # rows of 256: K-quant blocks


def _kquant_mix(name: str) -> Q:
    """A llama.cpp Q4_K_M-like mix, with Q5_K layers, and the legacy fallbacks it uses where K-quants don't fit."""
    if name == "output.weight" or ".attn_v." in name or ".ffn_down." in name:
        return Q.Q6_K
    if name == "token_embd.weight":
        return Q.Q4_K
    if name.startswith("blk.1.") and ".ffn_gate." in name:
        return Q.Q5_0  # llama.cpp's Q4_K fallback
    if name.startswith("blk.1.") and ".attn_k." in name:
        return Q.Q8_0  # kept as an MLX affine triple
    return Q.Q5_K if name.startswith("blk.1.") else Q.Q4_K


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_kquant_mixed_file_equals_folder(family: str, tokenizer_json: Path, tmp_path: Path) -> None:
    arch, extra = FAMILIES[family]
    config = {**_KQ_BASE, **extra, "head_dim": 64}
    rng = np.random.default_rng(7)
    probe = build_folder(tmp_path / "shapes", config, tokenizer_json)  # for the parameter names and shapes
    tmap = gguf.get_tensor_name_map(_ARCH[arch], config["num_hidden_layers"])
    blocks: dict[str, tuple[Q, np.ndarray]] = {}
    overrides: dict[str, np.ndarray] = {}
    for name, value in mx.load(str(probe / "model.safetensors")).items():
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if value.ndim != 2 or new is None:
            continue
        qtype = _kquant_mix(new)
        rows, cols = value.shape
        if qtype in REFERENCE:  # the folder holds exactly the values the blocks encode
            b = random_blocks(qtype, rows, cols, rng, scale=0.4 if "embd" in new or "output" in new else 0.05)
            blocks[new] = (qtype, b)
            overrides[name] = REFERENCE[qtype](b.reshape(rows * cols // 256, -1)).reshape(rows, cols)
        else:  # legacy types: gguf can quantize them; the folder holds llama.cpp's dequantization
            raw = gguf.quants.quantize(np.array(value), qtype)
            blocks[new] = (qtype, raw)
            overrides[name] = gguf.quants.dequantize(raw, qtype)
    folder = build_folder(tmp_path / f"tiny-{family}-kq", config, tokenizer_json, overrides=overrides)

    def type_for(name: str, value: np.ndarray) -> Q | tuple[Q, np.ndarray]:
        return blocks[name] if name in blocks else (_kquant_mix(name) if value.ndim == 2 else Q.F32)

    path = to_gguf(folder, tmp_path / f"tiny-{family}.Q4_K_M.gguf", arch, tokenizer_json, type_for)
    from trillm.engine.gguf import validate_gguf

    assert {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= validate_gguf(path).tensor_types
    ref = _folder_model(folder)
    g = load_gguf(path, dtype=mx.float32)  # the CPU default: everything dequantized
    assert_same_weights(g.model, ref, json.loads((folder / "config.json").read_text()), arch)
    ids = g.tokenizer.encode(PROMPT)
    want = _logits(ref, ids)
    assert mx.allclose(_logits(g.model, ids), want, atol=1e-4).item()
    # The GPU default keeps what MLX holds natively (Q4_K, Q5_K, Q8_0) quantized, computing in float32.
    kept = load_gguf(path, keep_quantized=True, dtype=None)
    assert kept.dtype == mx.float32
    native = sum(q in (Q.Q4_K, Q.Q5_K, Q.Q8_0) for name, (q, _) in blocks.items() if name != "token_embd.weight")
    assert native >= 5
    assert sum(type(m).__name__ == "QuantizedLinear" for _, m in kept.model.named_modules()) == native
    assert type(kept.model.model.embed_tokens).__name__ == "QuantizedEmbedding"  # Q4_K
    assert mx.allclose(_logits(kept.model, ids), want, atol=1e-4).item()


@pytest.mark.parametrize(
    ("family", "qtype"),
    [("qwen3", Q.F16), ("gemma3", Q.BF16), ("phi3", Q.Q8_0), ("gemma2", Q.Q4_0), ("mistral3", Q.Q4_1),
     ("qwen2", Q.Q5_0)],
)
def test_whole_file_of_one_type_equals_folder(family: str, qtype: Q, tokenizer_json: Path, tmp_path: Path) -> None:
    """convert_hf_to_gguf --outtype f16/bf16/q8_0 and llama-quantize's legacy types, per family: the folder
    holds llama.cpp's dequantization of each stored matrix (gguf.quants), the loader must give exactly that."""
    arch, extra = FAMILIES[family]
    config = {**_BASE, **extra}
    probe = build_folder(tmp_path / "shapes", config, tokenizer_json)
    tmap = gguf.get_tensor_name_map(_ARCH[arch], config["num_hidden_layers"])
    stored: dict[str, tuple[Q, np.ndarray]] = {}
    overrides: dict[str, np.ndarray] = {}
    for name, value in mx.load(str(probe / "model.safetensors")).items():
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if value.ndim == 2 and new is not None:
            raw = gguf.quants.quantize(np.array(value), qtype)
            overrides[name] = gguf.quants.dequantize(raw, qtype)
            stored[new] = (qtype, raw.view(np.uint8) if qtype == Q.F16 else raw)
    folder = build_folder(tmp_path / f"tiny-{family}", config, tokenizer_json, overrides=overrides)
    path = to_gguf(folder, tmp_path / f"tiny-{family}.{qtype.name}.gguf", arch, tokenizer_json,
                   lambda name, value: stored.get(name, Q.F32))
    ref = _folder_model(folder)
    g = load_gguf(path, dtype=mx.float32)
    assert_same_weights(g.model, ref, json.loads((folder / "config.json").read_text()), arch)
    ids = g.tokenizer.encode(PROMPT)
    want = _logits(ref, ids)
    assert mx.allclose(_logits(g.model, ids), want, atol=1e-4).item()
    kept = load_gguf(path, keep_quantized=True, dtype=None)  # the GPU default
    quantized = sum(type(m).__name__.startswith("Quantized") for _, m in kept.model.named_modules())
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        assert kept.dtype == mx.float32 and quantized > 0
    else:  # float files compute in their own dtype; Q5_0 has no MLX layout and is dequantized
        assert quantized == 0
        assert kept.dtype == {Q.F16: mx.float16, Q.BF16: mx.bfloat16, Q.Q5_0: mx.float32}[qtype]
    tol = {Q.F16: 5e-2, Q.BF16: 2e-1}.get(qtype, 1e-4)  # half-precision activations
    assert mx.allclose(_logits(kept.model, ids).astype(mx.float32), want, atol=tol, rtol=tol).item()


def test_phi3_file_with_separate_qkv_is_fused(tokenizer_json: Path, tmp_path: Path) -> None:
    arch, extra = FAMILIES["phi3"]
    folder = build_folder(tmp_path / "tiny-phi3", {**_BASE, **extra}, tokenizer_json)
    path = to_gguf(folder, tmp_path / "tiny-phi3.gguf", arch, tokenizer_json, split_qkv=True)
    from trillm.engine.gguf import read_gguf_metadata, validate_gguf

    assert validate_gguf(path).num_tensors > 0 and read_gguf_metadata(path)["general.architecture"] == "phi3"
    assert "blk.0.attn_q.weight" in read_gguf(path)[0] and "blk.0.attn_qkv.weight" not in read_gguf(path)[0]
    ref = _folder_model(folder)
    g = load_gguf(path, dtype=mx.float32)
    assert_same_weights(g.model, ref, json.loads((folder / "config.json").read_text()), arch)
    ids = g.tokenizer.encode(PROMPT)
    assert mx.array_equal(_logits(g.model, ids), _logits(ref, ids)).item()


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q5_1, Q.IQ4_NL])
def test_other_types_load_as_llama_cpp_dequantizes_them(qtype: Q) -> None:
    """Types people meet less (Q2_K/Q3_K files, Q5_1 fallbacks, IQ4_NL) take the same gguf.quants path."""
    rng = np.random.default_rng(int(qtype))
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(4, 512 // block * nbytes), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # random bits include fp16 NaN/inf scales
        want = gguf.quants.dequantize(raw, qtype)
        got = read_tensor(raw.reshape(-1), TensorInfo("x.weight", (4, 512), int(qtype), 0, raw.nbytes))["x.weight"]
    assert np.array_equal(np.array(got), want, equal_nan=True)


# --- refusals ------------------------------------------------------------------------------------------------


def _gguf_with(tmp_path: Path, arch: str, extra: dict[str, Any], tokenizer_json: Path, family: str = "llama") -> Path:
    _, base = FAMILIES[family]
    folder = build_folder(tmp_path / "f", {**_BASE, **base}, tokenizer_json)
    c = json.loads((folder / "config.json").read_text())
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, arch if arch in _ARCH else "llama", c, tokenizer_json, "x")
    for key, value in extra.items():
        for kv in w.kv_data:  # replace what _write_metadata wrote
            kv.pop(key, None)
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c["num_hidden_layers"])
    for name, value in mx.load(str(folder / "model.safetensors")).items():
        w.add_tensor(tmap.get_name(name, try_suffixes=(".weight", ".bias")), np.array(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        ("mamba2", {}, "unsupported GGUF architecture 'mamba2'"),
        ("starcoder2", {}, "unsupported GGUF architecture 'starcoder2'"),
        ("mistral3", {"mistral3.attention.temperature_scale": 0.1}, "attention temperature scaling"),
        ("llama", {"llama.rope.dimension_count": 8}, "partial RoPE"),
        ("llama", {"llama.block_count": 5_000_000}, "block_count is 5000000, the file holds 2 blocks"),
        ("llama", {"llama.attention.head_count_kv": [2, 1]}, "per-layer llama.attention.head_count_kv"),
    ],
)
def test_unsupported_gguf_is_refused_in_one_line(
    arch: str, extra: dict[str, Any], message: str, tokenizer_json: Path, tmp_path: Path
) -> None:
    path = _gguf_with(tmp_path, arch, extra, tokenizer_json)
    with pytest.raises(CorruptModelFile, match=message) as info:
        load_model(str(path))
    assert "\n" not in str(info.value)


def test_non_periodic_gemma3_pattern_is_refused(tokenizer_json: Path, tmp_path: Path) -> None:
    _, extra = FAMILIES["gemma3-pattern2"]
    folder = build_folder(tmp_path / "g3", {**_BASE, **extra}, tokenizer_json)
    path = to_gguf(folder, tmp_path / "g3.gguf", "gemma3", tokenizer_json)
    data = bytearray(path.read_bytes())
    # The bool array the converter wrote for pattern 2 (after the key: value type, item type, count), made
    # irregular.
    at = data.index(b"gemma3.attention.sliding_window_pattern") + len("gemma3.attention.sliding_window_pattern") + 16
    assert bytes(data[at : at + 4]) == bytes([1, 0, 1, 0])
    data[at : at + 4] = bytes([1, 1, 0, 0])
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptModelFile, match="not periodic"):
        load_gguf(path)


def test_tekken_and_gpt4o_pre_tokenizers_split_like_their_regexes() -> None:
    from trillm.engine.gguf_tokenizer import _pre_tokenizer

    def split(pre: str, text: str) -> list[str]:
        return [t for t, _ in _pre_tokenizer(pre, "").pre_tokenize_str(text)]

    # Tekken: case-split words, single digits; GPT-4o: contractions kept on the word, digits in threes.
    assert split("tekken", "HelloWorld it's 12345") == ["Hello", "World", "Ġit", "'s", "Ġ", "1", "2", "3", "4", "5"]
    assert split("gpt-4o", "HelloWorld it's 12345") == ["Hello", "World", "Ġit's", "Ġ", "123", "45"]


def test_chat_turn_enders_stop_generation_as_in_llama_cpp() -> None:
    """Gemma's <end_of_turn> and Phi-3's <|end|> are in no GGUF key; llama.cpp ends on them by text."""
    from trillm.engine.gguf_tokenizer import gguf_eos_ids

    gemma = {"tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "a"],
             "tokenizer.ggml.eos_token_id": 1}
    assert gguf_eos_ids(gemma) == {1, 4}
    phi3 = {"tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|end|>", "<|user|>"],
            "tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.eot_token_id": 4}
    assert gguf_eos_ids(phi3) == {3, 4}
    assert gguf_eos_ids({"tokenizer.ggml.tokens": ["<|endoftext|>", "x"]}) == frozenset()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_through_the_engine_equals_mlx_lm_on_the_folder(
    family: str, tokenizer_json: Path, tmp_path: Path
) -> None:
    """What a user runs: `trillm serve x.gguf`'s engine, batched, on prompts across KV blocks and past Gemma 3's
    window of 8, gives the tokens mlx-lm's own generate gives from the original folder."""
    from mlx_lm.generate import generate_step

    from trillm.engine.config import EngineConfig
    from trillm.engine.llm_engine import LLMEngine
    from trillm.engine.sampling_params import SamplingParams

    arch, extra = FAMILIES[family]
    folder = build_folder(tmp_path / f"tiny-{family}", {**_BASE, **extra}, tokenizer_json)
    loaded = load_model(str(to_gguf(folder, tmp_path / f"tiny-{family}.F32.gguf", arch, tokenizer_json)))
    ref = _folder_model(folder)
    texts = ["hello there", "the quick brown fox jumps over the lazy dog " * 3, "0123456789 " * 4]
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    eng = LLMEngine(EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256),
                    loaded=loaded)
    got = [list(o.new_token_ids) for o in eng.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                                               ignore_eos=True))]
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    want = [[int(t) for t, _ in generate_step(mx.array(p), ref, max_tokens=16, sampler=argmax)] for p in prompts]
    assert got == want
    assert len({t for seq in want for t in seq}) > 6  # not a degenerate echo
