"""Streaming text for one request: incremental detokenizing and stop strings.

`IncrementalDetokenizer` decodes a sliding window of ids (the prefix/read offsets of TGI and vLLM) and emits
text only once it no longer ends in U+FFFD, so a multi-byte character split across tokens is never broken.
`StopStringMatcher` holds back any tail that could still grow into a stop string, so a stop string spanning
token boundaries is caught and trimmed before any of it is emitted.
"""

from __future__ import annotations

from trillm.engine.tokenizer import TokenizerLike

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context (SentencePiece drops a leading space otherwise)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: list[int], *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopStringMatcher:
    def __init__(self, stop: tuple[str, ...], *, include_stop: bool = False) -> None:
        self._stop = stop
        self._include = include_stop
        self._pending = ""
        self._hold = max((len(s) for s in stop), default=0) - 1

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string matched or None)."""
        if not self._stop:
            return text, None
        buf = self._pending + text
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self._pending = ""
            return (buf[: i + len(s)] if self._include else buf[:i]), s
        # Hold back the longest tail that is a prefix of some stop string.
        keep = 0
        for n in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stop):
                keep = n
                break
        self._pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
