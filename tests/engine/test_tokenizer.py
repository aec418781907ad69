"""Tokenizer: lossless round trips, token bytes, special tokens and chat templates (tiny and SmolLM2)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trillm.engine.errors import InvalidRequest
from trillm.engine.loader import LoadedModel
from trillm.engine.tokenizer import Tokenizer, bytes_to_unicode

SAMPLES = [
    "Hello world",
    "Hello world 12345",
    "0123456789 3.14159 -42 1e-9",
    "東京は日本の首都です。北京是中国的首都。",
    "emoji 😀🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "   leading, trailing   ",
    "tabs\t\tand\nnew\n\n\nlines  \r\n  runs       of spaces",
    "Ünïcödé çàfé naïve — “quotes” ‘single’ …",
    "",
]


def _round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # token_bytes is an independent path: the bytes of the pieces must concatenate to the UTF-8 text.
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@pytest.mark.parametrize("text", SAMPLES)
def test_tiny_round_trip(tiny_model: LoadedModel, text: str) -> None:
    _round_trip(tiny_model.tokenizer, text)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_tiny_round_trip_any_unicode(tiny_model: LoadedModel, text: str) -> None:
    assume("<|" not in text)  # special-token strings are meant to map to their ids
    _round_trip(tiny_model.tokenizer, text)


def test_tiny_special_tokens(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.encode("<|im_end|>") == [im_end]
    assert tok.eos_token_ids == frozenset({im_end})
    assert im_end in tok.all_special_ids
    assert tok.token_bytes(im_end) == b"<|im_end|>"
    assert tok.decode([im_end]) == ""
    assert tok.decode([im_end], skip_special_tokens=False) == "<|im_end|>"
    with pytest.raises(InvalidRequest):
        tok.token_bytes(tok.vocab_size + 10)


def test_tiny_chat_template(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat_template(messages) == want
    assert tok.apply_chat_template(messages) == tok.encode(want)
    no_prompt = tok.render_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == want.removesuffix("<|im_start|>assistant\n")


def test_chat_template_bad_messages(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template([])
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template([{"role": "user"}])  # no content


def _bare_byte_level_tokenizer(specials: list[str]) -> Tokenizer:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = list(bytes_to_unicode().values())
    rust = RustTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens(specials)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust))


def test_no_template_chatml_fallback_or_clear_error() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    chatml = _bare_byte_level_tokenizer(["<|im_start|>", "<|im_end|>"])
    assert chatml.render_chat_template(messages) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    plain = _bare_byte_level_tokenizer([])
    assert not plain.has_chat_template
    with pytest.raises(InvalidRequest, match="no chat template"):
        plain.apply_chat_template(messages)
    _round_trip(plain, "bytes only: é 😀")


# --- the real default model's tokenizer (SmolLM2, rebuilt from GGUF metadata) ------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_round_trip(default_model: LoadedModel, text: str) -> None:
    _round_trip(default_model.tokenizer, text)


@functools.cache
def _single_bytes(tok: Tokenizer) -> frozenset[int]:
    return frozenset(b[0] for i in range(tok.vocab_size) if len(b := tok.token_bytes(i)) == 1)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_smollm2_round_trip_any_unicode(default_model: LoadedModel, text: str) -> None:
    tok = default_model.tokenizer
    # SmolLM2's vocabulary lacks 21 of the 256 byte symbols (0x04, 0xF1, ... : rare controls and unassigned
    # planes 4-11), so text with those bytes cannot be represented by the model at all.
    assume("<" not in text and set(text.encode()) <= _single_bytes(tok))
    _round_trip(tok, text)


@pytest.mark.slow
def test_smollm2_pre_tokenizer_pieces(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    pieces = [tok.token_bytes(i).decode() for i in tok.encode("Hello world 12345")]
    assert pieces == ["Hello", " world", " ", "1", "2", "3", "4", "5"]


@pytest.mark.slow
def test_smollm2_special_tokens(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= tok.all_special_ids
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # add_bos_token is false in the GGUF


@pytest.mark.slow
def test_smollm2_chat_template_is_chatml(default_model: LoadedModel) -> None:
    text = default_model.tokenizer.render_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sentencepiece_style_token_bytes() -> None:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581hi": 1, "<0xE2>": 2, "<0x82>": 3, "<0xAC>": 4, "x": 5}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust))
    assert tok.token_bytes(1) == b" hi"
    assert b"".join(tok.token_bytes(i) for i in (2, 3, 4)) == "€".encode()
    assert tok.decode([1, 2, 3, 4]) == " hi€"


def _spm_gguf_metadata() -> dict[str, object]:
    """A hand-made SentencePiece (GGUF tokenizer model "llama") vocabulary: pieces, scores, byte tokens."""
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "he", "ll", "llo", "\u2581he", "\u2581hello",
              "\u2581w", "or", "ld", "\u2581wor", "\u2581world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_gguf_sentencepiece_tokenizer() -> None:
    from trillm.engine.gguf_tokenizer import build_gguf_tokenizer

    tok = build_gguf_tokenizer(_spm_gguf_metadata())
    pieces = lambda text: [tok.hf.convert_ids_to_tokens(i) for i in tok.encode(text)]  # noqa: E731
    assert pieces("hello world") == ["\u2581hello", "\u2581world"]
    assert pieces("hello é") == ["\u2581hello", "\u2581", "<0xC3>", "<0xA9>"]  # byte fallback
    assert tok.encode("hello", add_special_tokens=True)[0] == 1  # llama GGUFs add BOS by default
    assert tok.eos_token_ids == frozenset({2}) and tok.bos_token_id == 1
    for text in ["hello world", "hello é 😀", " leading and  double  spaces ", "line\nbreak", ""]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        # SentencePiece pieces carry the space prepended to the text (llama.cpp's add_space_prefix).
        assert b"".join(tok.token_bytes(i) for i in ids) == (" " + text if text else "").encode()
