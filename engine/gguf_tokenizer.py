"""Rebuild a GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as a Hugging Face fast tokenizer.

Two GGUF tokenizer models are supported:
- "gpt2": byte-level BPE from tokens + merges, with the pre-tokenizer named by `tokenizer.ggml.pre`
  (gpt2, smollm, llama-bpe, qwen2 (also Qwen 3), tekken (Mistral Nemo / Small), gpt-4o (Phi-4)).
  Lossless: every byte string has exactly one spelling.
- "llama": SentencePiece BPE (Llama 2, Mistral, TinyLlama, Gemma, Phi-3) from tokens + scores; merges are
  derived from the scores as transformers' GGUF converter does, with byte fallback (`<0xXX>` tokens) for
  unseen bytes.
"""

from __future__ import annotations

from typing import Any

from trillm.engine.errors import CorruptModelFile
from trillm.engine.tokenizer import Tokenizer

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's Tekken (Nemo, Small 3) and GPT-4o's (Phi-4): the tokenizer.json regexes llama-vocab.cpp cites.
_CASED_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}|"
)
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN_SPLIT = _CASED_WORDS.replace("{c}", "") + r"\p{N}|" + _TAIL
_GPT4O_SPLIT = _CASED_WORDS.replace("{c}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?") + r"\p{N}{1,3}|" + _TAIL
# llama-vocab.cpp's names for each split (DeepSeek-R1 Qwen distills say deepseek-r1-qwen; DBRX/Smaug reuse
# Llama 3's regex without its merge skipping).
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral")
_SPLITS = {
    **dict.fromkeys(_LLAMA3_NAMES, _LLAMA3_SPLIT), "dbrx": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT, "gpt-4o": _GPT4O_SPLIT,
}
_IGNORE_MERGES = (*_LLAMA3_NAMES, "tekken")  # llama-vocab.cpp: whole-word vocabulary hits skip merges
_ADD_BOS = (*_LLAMA3_NAMES, "tekken")  # llama.cpp adds BOS for these when the file does not say
# llama.cpp token types
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space


def _pre_tokenizer(pre: str, path: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default", "gpt-2", "phi-2"):
        return byte_level
    if pre == "smollm":  # SmolLM/StarCoder: every digit alone, then GPT-2's byte-level split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = ", ".join(["gpt2", "smollm", *_SPLITS])
    raise CorruptModelFile(f"{path}: unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")


# Chat turn enders llama.cpp ends generation on by their text (llama-vocab.cpp), since converters store one
# eos id: Gemma's <end_of_turn> and Phi-3's <|end|> are in no key. (llama.cpp's list also has document
# enders such as <|endoftext|>; those stay out, as they do in the HF configs.)
_TURN_ENDS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>"})


def gguf_eos_ids(meta: dict[str, Any]) -> frozenset[int]:
    """EOS plus end-of-turn / end-of-message ids named in the metadata, and the chat turn enders by text."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    named = {int(meta[k]) for k in keys if meta.get(k) is not None}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return frozenset(named | {i for i, t in enumerate(tokens) if t in _TURN_ENDS})


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary pieces,
    ranked by the merged token's score (higher merges first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, str, str]] = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[token], left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _byte_level_model(meta: dict[str, Any], tokens: list[str], path: str) -> Any:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models

    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])],
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in _IGNORE_MERGES,
    )
    tok = RustTokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre, path)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_model(meta: dict[str, Any], tokens: list[str], unk: str | None, path: str) -> Any:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise CorruptModelFile(f"{path}: SentencePiece GGUF tokenizer lacks tokenizer.ggml.scores")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=spm_merges(tokens, scores),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = RustTokenizer(bpe)
    add_space = meta.get("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if add_space else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(" ", 1, 0))  # drop the space the normalizer prepended
    tok.decoder = decoders.Sequence(steps)
    return tok


def build_gguf_tokenizer(meta: dict[str, Any], path: str = "") -> Tokenizer:
    """The tokenizer stored in `tokenizer.ggml.*`, with control tokens as specials and the chat template."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_model(meta, tokens, path)
    elif kind == "llama":
        tok = _spm_model(meta, tokens, token("unknown"), path)
    else:
        raise CorruptModelFile(f"{path}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    special_types = (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in special_types]
    )
    tok.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
    )
    bos = token("bos")
    # llama.cpp's default per model when the key is absent (SentencePiece and Tekken add BOS)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or meta.get("tokenizer.ggml.pre") in _ADD_BOS)
    if add_bos and bos is not None:
        bos_id = tokens.index(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return Tokenizer(hf, eos_token_ids=gguf_eos_ids(meta))
