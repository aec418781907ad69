"""Streaming text for one request: incremental detokenizing and stop strings.

`IncrementalDetokenizer` decodes a sliding window of ids (the prefix/read offsets of TGI and vLLM) and emits
text only once it no longer ends in U+FFFD, so a multi-byte character split across tokens is never broken.
`StopStringMatcher` holds back any tail that could still grow into a stop string, so a stop string spanning
token boundaries is caught and trimmed before any of it is emitted.
"""

from __future__ import annotations

from trillm.engine.tokenizer import TokenizerLike

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context (SentencePiece drops a leading space otherwise)
# Tokens held back for an incomplete character. A character is at most 4 bytes, so once more tokens than
# this are held and the text still ends in U+FFFD, the held bytes are invalid (lone continuation bytes), not a
# character in progress: the decided part is released (`_release`), which keeps the window bounded.
_MAX_HELD = 8


class IncrementalDetokenizer:
    """Decodes a window of at most about 2 * _MAX_HELD tokens per token, whatever the stream: a token that
    decodes to nothing (a skipped special token) never enters the window, and invalid bytes are released past
    _MAX_HELD tokens, so the cost per token stays flat (never the whole output decoded at each step)."""

    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: list[int], *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if 0 <= t < tokenizer.vocab_size]
        self._prefix = 0  # ids[prefix:read]: the last text emitted, decoded again as context
        self._read = len(self._ids)  # ids[read:]: held back (an incomplete character)
        self._held_text = ""  # the text of ids[prefix:] while some are held

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < self._tok.vocab_size:
            return ""  # an id past the tokenizer's vocabulary (a padded embedding row) has no text
        before_held = self._read < len(self._ids)
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if new_text == (self._held_text if before_held else prefix_text) and self._decode([token_id]) == "":
            # It decodes to nothing, alone and here (a skipped special token): keep it out of the window.
            # (A continuation byte may also leave the text unchanged, but alone it decodes to U+FFFD.)
            self._ids.pop()
            return ""
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._advance(len(self._ids))
            return new_text[len(prefix_text) :]
        if len(self._ids) - self._read > _MAX_HELD:
            return self._release(prefix_text, new_text)
        self._held_text = new_text
        return ""

    def _advance(self, read: int) -> None:
        """ids[read_before:read] were emitted: they become the context; drop what is older."""
        del self._ids[: self._read]
        self._prefix, self._read = 0, read - self._read
        self._held_text = self._decode(self._ids) if self._read < len(self._ids) else ""

    def _release(self, prefix_text: str, new_text: str) -> str:
        """Too many tokens held: emit the longest run of them whose text is already decided, that is a token
        boundary whose text is a prefix of the window's and stops before its last (incomplete) character."""
        for j in range(len(self._ids) - 1, self._read, -1):
            text = self._decode(self._ids[self._prefix : j])
            if len(prefix_text) < len(text) < len(new_text) and new_text.startswith(text):
                self._advance(j)
                return text[len(prefix_text) :]
        if len(self._ids) - self._read <= 4 * _MAX_HELD:
            self._held_text = new_text
            return ""
        self._advance(len(self._ids))  # never found (a tokenizer this cannot reason about): bound it anyway
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._advance(len(self._ids))
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopStringMatcher:
    """Stop strings over streamed text in time linear in the text: one KMP automaton per stop string.

    Each automaton's state is the longest prefix of its stop string that the text ends with; the longest of
    those is the tail held back (it may still grow into a stop). The first stop string to complete ends the
    request (of several completing on the same character, the one that starts earliest).
    """

    def __init__(self, stop: tuple[str, ...], *, include_stop: bool = False) -> None:
        self._stop = stop
        self._fail = [_failure(s) for s in stop]
        self._state = [0] * len(stop)
        self._include = include_stop
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string matched or None)."""
        if not self._stop:
            return text, None
        buf = self._pending + text
        offset = len(self._pending)  # the held-back tail is already reflected in the states
        for j, ch in enumerate(text):
            pos = offset + j
            best: tuple[int, str] | None = None
            for k, s in enumerate(self._stop):
                st, fail = self._state[k], self._fail[k]
                while st and s[st] != ch:
                    st = fail[st - 1]
                if s[st] == ch:
                    st += 1
                if st == len(s):
                    begin = pos - len(s) + 1
                    if best is None or begin < best[0]:
                        best = (begin, s)
                    st = fail[st - 1]
                self._state[k] = st
            if best is not None:
                begin, s = best
                self._pending = ""
                self._state = [0] * len(self._stop)
                return (buf[: pos + 1] if self._include else buf[:begin]), s
        hold = max(self._state)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        self._state = [0] * len(self._stop)
        return out
