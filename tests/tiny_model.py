"""Tiny random-weight llama models for fast tests, built offline in about a second.

`build_tiny_model` writes an HF-style MLX folder that loads through both trillm's `load_model` and
`mlx_lm.load`; `tiny_model_to_gguf` converts such a folder into an F32 llama GGUF the way llama.cpp's
converter does (Q/K rows permuted for interleaved RoPE), to test the GGUF loader against the folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import trillm.kernels  # noqa: F401  (BLAS first)

import mlx.core as mx
from mlx.utils import tree_flatten

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Local training text: English, code, digits, whitespace runs, accents, CJK and emoji, so merges exist for each.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Once upon a time, there was a small model that learned to count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n",
    "Hello world! Hello there. How are you today? I am fine, thank you very much.",
    "Café, naïve, résumé, jalapeño, Zürich, São Paulo, Kraków.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 😀 😃 🚀 🎉 👍 — and symbols: ∑ ∞ ≈ ≠ → ←.",
    "    indented    text\twith\ttabs\n\n\nand   many   spaces   ",
    "system\nYou are a helpful assistant.\nuser\nWhat is two plus two?\nassistant\nTwo plus two is four.",
    "In 1969, 600 million people watched the Moon landing; in 2024 the number 3.14159 is still pi.",
]


def train_tiny_tokenizer(vocab_size: int = 512) -> "object":
    """A byte-level BPE (GPT-2 style) with ChatML specials, trained on the local corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def build_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random-weight llama model folder (fp32 safetensors + byte-level BPE tokenizer) to `path`."""
    from mlx_lm.models import llama

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(vocab_size)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|im_end|>")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "rope_traditional": False,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    # Spread the output layer so greedy choices have clear margins (random init gives near-ties).
    head = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
    params[head] = params[head] * 8.0
    mx.save_safetensors(str(path / "model.safetensors"), {k: v.astype(mx.float32) for k, v in params.items()})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "chat_template": CHATML_TEMPLATE,
                "clean_up_tokenization_spaces": False,
                "model_max_length": max_position_embeddings,
            },
            indent=2,
        )
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )
    return path


def _permute_for_gguf(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp convert_hf_to_gguf: rows of each head go from half-split to interleaved RoPE pairs.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_model_to_gguf(folder: Path, out: Path) -> Path:
    """Convert a `build_tiny_model` folder to an F32 llama GGUF with the tokenizer in its metadata."""
    folder, out = Path(folder), Path(out)
    config = json.loads((folder / "config.json").read_text())
    spec = json.loads((folder / "tokenizer.json").read_text())
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    weights = mx.load(str(folder / "model.safetensors"))
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    tensors: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = value
        elif key == "model.norm.weight":
            tensors["output_norm.weight"] = value
        elif key == "lm_head.weight":
            tensors["output.weight"] = value
        else:
            _, _, layer, rest = key.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            if module == "self_attn.q_proj":
                value = _permute_for_gguf(value, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                value = _permute_for_gguf(value, config["num_key_value_heads"])
            tensors[f"blk.{layer}.{names[module]}.{suffix}"] = value
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    assert [i for _, i in vocab] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": "llama",
        "general.name": folder.name,
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.rope.dimension_count": u32(config["head_dim"]),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "llama.vocab_size": u32(len(tokens)),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if i in specials else 1 for i in range(len(tokens))], dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(ids["<|im_end|>"]),
        "tokenizer.ggml.padding_token_id": u32(ids["<|endoftext|>"]),
        "tokenizer.chat_template": template,
    }
    mx.save_gguf(str(out), tensors, metadata)
    return out
