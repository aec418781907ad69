"""A tokenizer for the mock engine: no files, a realistic vocabulary size and about 5 bytes per token.

Ids 0-2 are special (0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>`; 0 and 2 end a generation). Every
other id is a space plus a short lowercase word (its index in base 26), so generated text looks like words and
has realistic payload sizes. `encode` maps each whitespace-separated word to one id: a word that spells an id
maps back to it (decode then encode is lossless), any other word to a stable hash. It never raises.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

from trillm.engine.tokenizer import SpecialTokens

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_SPECIAL = len(SPECIALS)
_SPLIT = re.compile(r"<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>|\S+")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _word(index: int) -> str:
    # bijective base 26: a..z, aa..zz, aaa..; 3 or 4 letters for most of a 49k vocabulary
    out = []
    index += 1
    while index:
        index, r = divmod(index - 1, 26)
        out.append(_LETTERS[r])
    return "".join(reversed(out))


def _index(word: str) -> int:
    n = 0
    for ch in word:
        n = n * 26 + (ord(ch) - 96)
    return n - 1


class MockTokenizer:
    """The tokenizer interface the engine and web layer use (encode, decode, chat template, token bytes)."""

    def __init__(self, vocab_size: int = 49152) -> None:
        if vocab_size <= NUM_SPECIAL + 1:
            raise ValueError(f"vocab_size must be > {NUM_SPECIAL + 1}")
        self.vocab_size = vocab_size
        self.eos_token_ids: frozenset[int] = frozenset({0, 2})
        self.bos_token_id: int | None = None
        self.all_special_ids: frozenset[int] = frozenset(range(NUM_SPECIAL))
        self.has_chat_template = True
        self.special_tokens = SpecialTokens(eos_token=SPECIALS[2], bos_token=None, pad_token=SPECIALS[0],
                                            chat_template=None)
        self._pieces = [s for s in SPECIALS] + [" " + _word(i) for i in range(vocab_size - NUM_SPECIAL)]
        self._bytes = [p.encode() for p in self._pieces]
        self._max_word = len(_word(vocab_size - NUM_SPECIAL - 1))

    def _id(self, word: str) -> int:
        if word in SPECIALS:
            return SPECIALS.index(word)
        if len(word) <= self._max_word and word.isascii() and word.isalpha() and word.islower():
            i = _index(word)
            if i < self.vocab_size - NUM_SPECIAL:
                return i + NUM_SPECIAL
        return NUM_SPECIAL + zlib.crc32(word.encode()) % (self.vocab_size - NUM_SPECIAL)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [self._id(w) for w in _SPLIT.findall(text)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        pieces = self._pieces
        if skip_special_tokens:
            return "".join(pieces[i] for i in ids if i >= NUM_SPECIAL)
        return "".join(pieces[i] for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def render_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                             add_generation_prompt: bool = True, **kw: Any) -> str:
        parts = [f"<|im_start|> {m.get('role', 'user')} {m.get('content') or ''} <|im_end|>" for m in messages]
        if tools:
            parts.insert(0, f"<|im_start|> system tools {len(tools)} <|im_end|>")
        if add_generation_prompt:
            parts.append("<|im_start|> assistant")
        return " ".join(parts)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        return self.encode(self.render_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt))
