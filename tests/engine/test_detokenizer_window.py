"""IncrementalDetokenizer: streamed text equals the tokenizer's own one-shot decode, and the window it decodes
stays bounded however many tokens decode to nothing (skipped special tokens) or to invalid bytes."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from trillm.engine.detokenizer import IncrementalDetokenizer
from trillm.engine.tokenizer import Tokenizer, bytes_to_unicode

from tiny_model import train_tiny_tokenizer


@cache
def byte_level() -> Tokenizer:
    """The tiny models' byte-level BPE (GPT-2 style, ChatML specials)."""
    from transformers import PreTrainedTokenizerFast

    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(), eos_token="<|im_end|>"))


@cache
def sentencepiece() -> Tokenizer:
    """Llama-style: Metaspace pieces, <0xNN> byte fallback, a decoder that strips the leading space."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["\u2581", "h", "e", "l", "o", "\u2581he", "llo", "\u2581hello", "\u2581w", "or", "ld", "\u2581world",
              "x", "\u00e9", "."]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {p: 259 + i for i, p in enumerate(pieces)}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    rust.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>"))


class Counting:
    """A tokenizer that records the length of every id list it decodes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.vocab_size = tok.vocab_size
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def stream(tok: Any, prompt: list[int], ids: list[int], skip: bool = True) -> str:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return "".join(d.add(t) for t in ids) + d.flush()


def byte_token(tok: Tokenizer, b: int) -> int:
    """The byte-level vocabulary's token for one raw byte."""
    token_id: int = tok.hf.convert_tokens_to_ids(bytes_to_unicode()[b])
    return token_id


@cache
def byte_tokens() -> list[int]:
    return [byte_token(byte_level(), b) for b in range(256)]


@pytest.mark.parametrize("kind", ["special", "continuation byte", "lead byte"])
def test_tokens_without_text_keep_the_window_and_the_cost_flat(kind: str) -> None:
    tok = byte_level()
    n = 8000
    token = {"special": tok.hf.convert_tokens_to_ids("<|im_start|>"), "continuation byte": byte_token(tok, 0x80),
             "lead byte": byte_token(tok, 0xE2)}[kind]
    hello = tok.encode("hello")
    ids = hello + [token] * n + tok.encode(" world")
    counting = Counting(tok)
    text = stream(counting, tok.encode("Say:"), ids)
    assert text == tok.decode(ids)
    assert max(counting.lengths) <= 20, max(counting.lengths)  # the window, not the whole output
    assert len(counting.lengths) <= 4 * len(ids)  # a few decodes per token
    assert sum(counting.lengths) <= 30 * len(ids)  # hence flat: no decode grows with the output


def test_skipped_specials_inside_a_character_and_kept_specials() -> None:
    tok = byte_level()
    special = tok.hf.convert_tokens_to_ids("<|im_end|>")
    euro = [byte_token(tok, b) for b in "€".encode()]
    ids = tok.encode("a") + euro[:1] + [special] * 50 + euro[1:2] + [special] + euro[2:] + tok.encode("b")
    assert stream(tok, [], ids) == tok.decode(ids) == "a€b"
    assert stream(tok, [], ids, skip=False) == tok.decode(ids, skip_special_tokens=False)


text_strategy = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60)


@settings(max_examples=150, deadline=None)
@given(text=text_strategy, specials=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 2)), max_size=6),
       prompt=st.text("abc é", max_size=8), which=st.sampled_from(["byte-level", "sentencepiece"]))
def test_ordinary_text_streams_as_its_one_shot_decode(text: str, specials: list[tuple[int, int]], prompt: str,
                                                      which: str) -> None:
    tok = byte_level() if which == "byte-level" else sentencepiece()
    ids = tok.encode(text)
    special_ids = sorted(tok.all_special_ids)
    for pos, k in specials:  # skipped specials anywhere, even inside a character's bytes
        ids.insert(pos % (len(ids) + 1), special_ids[k % len(special_ids)])
    prompt_ids = tok.encode(prompt) or [special_ids[0]]
    # The reference: the whole output decoded at once, in the context of the prompt (SentencePiece's strip).
    expected = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)):] if ids else ""
    assert stream(tok, prompt_ids, ids) == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_token_streams_stream_as_their_one_shot_decode(data: st.DataObject, skip: bool) -> None:
    # Byte-level BPE only: its decode is a lossy UTF-8 decode of the bytes, which streams. (SentencePiece's
    # ByteFallback turns a whole run of byte tokens into U+FFFDs when the run is invalid, "\x00" included:
    # no streaming decoder can match that once "\x00" is out, and none tries.)
    tok = byte_level()
    # Random ids, weighted towards raw bytes (continuation and lead bytes) and specials: the hard cases.
    bytes_ = byte_tokens()
    pool = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(bytes_[0x80:]),
                     st.sampled_from(sorted(tok.all_special_ids)))
    ids = data.draw(st.lists(pool, max_size=80))
    prompt = tok.encode("hi")
    expected = tok.decode(prompt + ids, skip_special_tokens=skip)[len(tok.decode(prompt, skip_special_tokens=skip)):]
    assert stream(tok, prompt, ids, skip) == expected
