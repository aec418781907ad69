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
        self._ids = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if 0 <= t < tokenizer.vocab_size]
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < self._tok.vocab_size:
            return ""  # an id past the tokenizer's vocabulary (a padded embedding row) has no text
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
