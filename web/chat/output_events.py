"""One choice's output as typed events: the contract every API front end renders.

The engine hands back text deltas. `ChoiceParser` (sans-IO, one per choice) turns them into these frozen
events, in output order:

- `ReasoningDelta(text)`: thinking text (between the model's reasoning markers; the markers are dropped).
- `TextDelta(text)`: answer text. Text that may still turn out to open a tool call (a partial `<tool_call>`)
  is held back until it is known not to, so no half marker is ever emitted.
- `ToolCallStart(index, id, name)`, then one or more `ToolCallArgumentsDelta(index, delta)` whose
  concatenation is the call's arguments (a JSON object as text), then `ToolCallEnd(index, arguments)` with
  the whole arguments text. Calls are numbered 0, 1, ... per choice; events of one call are never interleaved
  with another's. A block that looked like a call but does not parse as one is emitted as `TextDelta`.
- `OutputEnd(reason, stop_reason, error)`, last, exactly once: reason is "stop", "length", "tool_calls" (the
  output ended normally and made at least one call), "grammar" (the grammar engine could not continue; `error`
  says why) or "abort".

Every surface renders the same stream: OpenAI chat and text completions (web/openai/response.py), the
Anthropic Messages and OpenAI Responses translations, and /v1/ws (which the router proxies as it comes).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from trillm.engine.outputs import FinishReason, RequestOutput
from trillm.web.chat.reasoning import ReasoningFormat, ReasoningSplitter, held_back
from trillm.web.chat.tool_parsers import ParsedCall, ToolFormat

FinishKind = Literal["stop", "length", "tool_calls", "grammar", "abort", "error", "timeout"]
_END_KINDS: dict[FinishReason, FinishKind] = {  # a normal stop is "stop", or "tool_calls" after calls
    FinishReason.LENGTH: "length", FinishReason.GRAMMAR: "grammar", FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error", FinishReason.TIMEOUT: "timeout"}


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta:
    index: int
    delta: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class OutputEnd:
    reason: FinishKind
    stop_reason: str | int | None = None  # the stop string or token id that ended the output
    error: str | None = None  # reason "grammar": what the grammar engine reported


OutputEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | OutputEnd


@dataclass(frozen=True, slots=True)
class OutputParsing:
    """How one request's output is parsed (from the request and the model: web/chat/structured.py)."""

    tool_format: ToolFormat | None = None  # None: no tool-call parsing (no tools, or tool_choice "none")
    tools: tuple[dict[str, Any], ...] = ()
    reasoning: ReasoningFormat | None = None  # None: no reasoning split
    reasoning_inside: bool = False  # the prompt opened the reasoning block


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _ToolCallExtractor:
    """Answer text -> text and tool-call events, holding back what may be the start of a call."""

    def __init__(self, fmt: ToolFormat, tools: tuple[dict[str, Any], ...]) -> None:
        self.fmt = fmt
        self.tools = [dict(t) for t in tools] or None
        self.num_calls = 0
        self._in_call = False
        self._pending = ""  # held-back text, or the open call's body
        self._at_start = True  # nothing but whitespace seen yet (a Llama 3 call may start here)
        self._bare = False  # the open call began as a bare JSON object (no start marker)

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            fmt = self.fmt
            if self._in_call:
                j = buf.find(fmt.end) if fmt.end else -1
                if j < 0:
                    self._pending = buf  # the call runs on
                    return events
                events += self._close_call(buf[:j], raw=fmt.start + buf[: j + len(fmt.end)])
                buf = buf[j + len(fmt.end):]
                continue
            if fmt.call_at_start and self._at_start:
                stripped = buf.lstrip()
                if not stripped:
                    self._pending = buf
                    return events
                if stripped.startswith("{"):
                    self._at_start, self._in_call = False, True
                    self._bare = True
                    buf = stripped
                    continue
            i = buf.find(fmt.start)
            if i >= 0:
                if buf[:i]:
                    events.append(TextDelta(buf[:i]))
                self._at_start, self._in_call, self._bare = False, True, False
                buf = buf[i + len(fmt.start):]
                continue
            hold = held_back(buf, fmt.start)
            emit = buf[: len(buf) - hold]
            if emit:
                events.append(TextDelta(emit))
                self._at_start = self._at_start and not emit.strip()
            self._pending = buf[len(buf) - hold:]
            return events
        return events

    def _close_call(self, body: str, raw: str) -> list[OutputEvent]:
        self._in_call = False
        try:
            calls = self.fmt.parse(body, self.tools)
        except ValueError:
            return [TextDelta(raw)] if raw else []
        return self._call_events(calls)

    def _call_events(self, calls: list[ParsedCall]) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for call in calls:
            i = self.num_calls
            self.num_calls += 1
            events += [ToolCallStart(i, call.id or new_call_id(), call.name), ToolCallArgumentsDelta(i, call.arguments),
                       ToolCallEnd(i, call.arguments)]
        return events

    def flush(self) -> list[OutputEvent]:
        pending, self._pending = self._pending, ""
        if self._in_call:
            raw = pending if self._bare else self.fmt.start + pending
            return self._close_call(pending, raw=raw)
        return [TextDelta(pending)] if pending else []


class ChoiceParser:
    """One choice's deltas -> events (see the module docstring). Feed text as it comes, then `finish`."""

    def __init__(self, parsing: OutputParsing = OutputParsing()) -> None:
        self._reasoning = (ReasoningSplitter(parsing.reasoning, inside=parsing.reasoning_inside)
                           if parsing.reasoning is not None else None)
        self._tools = _ToolCallExtractor(parsing.tool_format, parsing.tools) if parsing.tool_format is not None else None
        self._finished = False

    def feed(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        return self._events(*self._reasoning.feed(text)) if self._reasoning is not None else self._answer(text)

    def _events(self, reasoning: str, answer: str) -> list[OutputEvent]:
        events: list[OutputEvent] = [ReasoningDelta(reasoning)] if reasoning else []
        return events + self._answer(answer)

    def _answer(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        if self._tools is None:
            return [TextDelta(text)]
        return self._tools.feed(text)

    def finish(self, reason: FinishReason, *, stop_reason: str | int | None = None,
               error: str | None = None) -> list[OutputEvent]:
        """Release everything held back, close an open call, and end with the one `OutputEnd`."""
        if self._finished:
            return []
        self._finished = True
        events = self._events(*self._reasoning.flush()) if self._reasoning is not None else []
        if self._tools is not None:
            events += self._tools.flush()
        called = self._tools is not None and self._tools.num_calls
        events.append(OutputEnd(_END_KINDS.get(reason) or ("tool_calls" if called else "stop"), stop_reason, error))
        return events

    def feed_output(self, out: RequestOutput) -> list[OutputEvent]:
        """One engine delta of this choice as its events; the last delta's end with the one `OutputEnd`."""
        events = self.feed(out.new_text)
        if out.finish_reason is not None:
            events += self.finish(out.finish_reason, stop_reason=out.stop_reason, error=out.error)
        return events


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments text as an object (Anthropic's tool_use `input`); {} for empty text."""
    value = json.loads(arguments) if arguments.strip() else {}
    return value if isinstance(value, dict) else {"value": value}
