"""Reasoning ("thinking") blocks: `<think>...</think>` kept apart from the answer.

A model that thinks writes its reasoning between two markers before answering (Qwen3, DeepSeek-R1 distills,
...). The markers are detected from the vocabulary and template (or named with `trillm serve
--reasoning-parser NAME`); whether a generation starts inside the block is read from the prompt, since some
templates open it themselves (DeepSeek-R1 distills end the prompt with `<think>\\n`; Qwen3 with
enable_thinking=false closes an empty one).

`ReasoningSplitter` is sans-IO: it takes text deltas and returns (reasoning, answer) pieces, holding back any
tail that could still be the start of a marker, so no half marker reaches a client.
"""

from __future__ import annotations

from dataclasses import dataclass

from trillm.engine.tokenizer import TokenizerLike

_MARKERS = {
    "think": ("<think>", "</think>"),  # Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3, ...
    "longcat": ("<longcat_think>", "</longcat_think>"),
    "think_colon": ("<|think:start|>", "<|think:end|>"),
}
REASONING_PARSERS = tuple(_MARKERS)


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str

    def starts_inside(self, prompt_text_tail: str) -> bool:
        """Whether a generation after this prompt begins inside the block (the template opened it)."""
        return prompt_text_tail.rstrip().endswith(self.start)


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in _MARKERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(REASONING_PARSERS)})")
    start, end = _MARKERS[name]
    return ReasoningFormat(name, start, end)


def detect_reasoning(tokenizer: TokenizerLike, template: str | None) -> ReasoningFormat | None:
    """The markers, if the model has them as single tokens (how thinking models are trained) or its template
    names them."""
    def one_token(marker: str) -> bool:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == marker

    for name, (start, end) in _MARKERS.items():
        if (one_token(start) and one_token(end)) or (template is not None and start in template and end in template):
            return ReasoningFormat(name, start, end)
    return None


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one choice's text into reasoning and answer (one block, at the start of the output)."""

    def __init__(self, fmt: ReasoningFormat, *, inside: bool) -> None:
        self.fmt = fmt
        self._state = "inside" if inside else "before"  # before: the block may still open
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text that is safe to emit now."""
        buf = self._pending + text
        self._pending = ""
        reasoning = answer = ""
        while buf:
            if self._state == "before":
                stripped = buf.lstrip()
                if stripped.startswith(self.fmt.start):
                    buf = stripped[len(self.fmt.start):]
                    self._state = "inside"
                    continue
                if self.fmt.start.startswith(stripped):
                    self._pending = buf  # still could be the opening marker
                    return reasoning, answer
                self._state = "answer"
                continue
            if self._state == "inside":
                i = buf.find(self.fmt.end)
                if i >= 0:
                    reasoning += buf[:i]
                    buf = buf[i + len(self.fmt.end):]
                    self._state = "after"
                    continue
                hold = held_back(buf, self.fmt.end)
                reasoning += buf[: len(buf) - hold]
                self._pending = buf[len(buf) - hold:]
                return reasoning, answer
            if self._state == "after":  # the whitespace between the block and the answer is neither
                buf = buf.lstrip()
                if not buf:
                    return reasoning, answer
                self._state = "answer"
            answer += buf
            buf = ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._state == "inside":
            return pending, ""
        return "", pending if self._state != "after" else pending.lstrip()
