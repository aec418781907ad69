"""The engine's tokenizer: a thin, lossless wrapper around a Hugging Face fast tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import jinja2

from trillm.engine.errors import InvalidRequest

# Used only when a tokenizer has no chat template but does have the ChatML markers (documented in README).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """A tokenizer's special-token strings and chat template, as clients that tokenize remotely ask for them."""

    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None


class TokenizerLike(Protocol):
    """What the engine and the web layer need of a tokenizer (`Tokenizer` here, or the mock engine's)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def special_tokens(self) -> SpecialTokens: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]: ...


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


def _component_types(node: Any) -> set[str]:
    """Every `type` named in a tokenizer.json component tree (Sequence decoders nest)."""
    found: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            found.add(node["type"])
        for value in node.values():
            found |= _component_types(value)
    elif isinstance(node, list):
        for value in node:
            found |= _component_types(value)
    return found


class Tokenizer:
    """Encode/decode text, render chat templates, and expose the raw bytes of every token.

    `hf` is the underlying transformers fast tokenizer (mlx-lm's tools take it). Encoding and decoding go
    straight to the Rust backend: no clean-up of spaces, so decode(encode(s)) == s for byte-level BPE.
    """

    def __init__(self, hf: Any, *, eos_token_ids: Iterable[int] = ()) -> None:
        if getattr(hf, "backend_tokenizer", None) is None:
            raise TypeError("Tokenizer needs a transformers *fast* tokenizer (with a `tokenizers` backend)")
        self.hf = hf
        self._backend = hf.backend_tokenizer
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token_id: int | None = None if hf.bos_token_id is None else int(hf.bos_token_id)
        self.vocab_size: int = len(hf)
        self.all_special_ids: frozenset[int] = frozenset(int(i) for i in hf.all_special_ids) | self.eos_token_ids

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings inside `text` map to their ids."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (a partial multi-byte character decodes to U+FFFD; use token_bytes to stream)."""
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (the logprobs `bytes` field)."""
        if not 0 <= token_id < len(self._bytes_table):
            raise InvalidRequest(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self._bytes_table[token_id]

    @cached_property
    def _decoder_types(self) -> set[str]:
        decoder = self._backend.decoder
        return _component_types(json.loads(decoder.__getstate__())) if decoder is not None else set()

    @cached_property
    def _bytes_table(self) -> list[bytes]:
        byte_level = "ByteLevel" in self._decoder_types
        spm = bool(self._decoder_types & {"ByteFallback", "Metaspace"})
        added = set(self._backend.get_added_tokens_decoder())
        size = max(self._backend.get_vocab_size(with_added_tokens=True), self.vocab_size)
        table: list[bytes] = []
        for token_id in range(size):
            piece = self._backend.id_to_token(token_id)
            if piece is None:
                table.append(b"")
            elif token_id in added:
                table.append(piece.encode("utf-8"))
            elif byte_level:
                table.append(_byte_level_bytes(piece))
            elif spm:
                table.append(_spm_bytes(piece))
            else:
                table.append(piece.encode("utf-8"))
        return table

    @property
    def has_chat_template(self) -> bool:
        return self.hf.chat_template is not None

    @cached_property
    def special_tokens(self) -> SpecialTokens:
        def text(value: Any) -> str | None:
            return value if isinstance(value, str) and value else None

        eos = text(self.hf.eos_token)
        if eos is None and self.eos_token_ids:
            eos = self.decode([min(self.eos_token_ids)], skip_special_tokens=False) or None
        template = text(self.hf.chat_template)
        if template is None and self.hf.convert_tokens_to_ids("<|im_start|>") not in (None, self.hf.unk_token_id):
            template = CHATML_TEMPLATE  # what render_chat_template falls back to
        return SpecialTokens(eos, text(self.hf.bos_token), text(self.hf.pad_token), template)

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text of `messages` under the model's chat template (ChatML when it has none)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list")
        template = self.hf.chat_template
        if template is None:
            if self.hf.convert_tokens_to_ids("<|im_start|>") in (None, self.hf.unk_token_id):
                raise InvalidRequest("this model has no chat template; send a plain prompt instead of messages")
            template = CHATML_TEMPLATE
        try:
            text = self.hf.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                chat_template=template,
                **template_kwargs,
            )
        except (jinja2.TemplateError, TypeError, KeyError, ValueError, AttributeError, IndexError) as exc:
            raise InvalidRequest(f"cannot render the chat template for these messages: {exc}") from exc
        if not isinstance(text, str):
            raise InvalidRequest("the chat template did not render to text")
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render `messages` with the chat template, then encode (the template itself places BOS etc.)."""
        text = self.render_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def mlx_lm_wrapper(self) -> Any:
        """An mlx-lm TokenizerWrapper over the same tokenizer and EOS set (for mlx-lm's generate)."""
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, NaiveStreamingDetokenizer, TokenizerWrapper

        detok = BPEStreamingDetokenizer if "ByteLevel" in self._decoder_types else NaiveStreamingDetokenizer
        return TokenizerWrapper(self.hf, detok, eos_token_ids=sorted(self.eos_token_ids))


def _byte_level_bytes(piece: str) -> bytes:
    try:
        return bytes(_BYTE_DECODER[c] for c in piece)
    except KeyError:  # a piece outside the byte alphabet: take it literally
        return piece.encode("utf-8")


def _spm_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")
