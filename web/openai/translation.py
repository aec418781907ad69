"""What the Messages and Responses translations share, around the one generation path of chat completions.

Both APIs translate their request into the internal chat completion body (openai/schema.py ChatCompletionRequest),
so templates, tools, grammars and usage are chat completions' own; and both render the same per-choice output
events (web/chat/output_events.py) in their own wire format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from trillm.engine.outputs import RequestOutput, Usage
from trillm.web.chat.output_events import ChoiceParser, OutputEvent
from trillm.web.http.sse import sse_named_event
from trillm.web.openai.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class FitMaxTokens:
    """An agent's max_tokens is an upper bound: lowered to the room the prompt leaves in the context.

    Agents ask for more than a local model's context holds (Claude Code asks for 32000), so the internal
    body asks for the rest of the context (max_tokens absent), and this lowers that to what the client asked.
    """

    requested: int | None  # None: as much as fits

    def __call__(self, req: GenerationRequest) -> GenerationRequest:
        if self.requested is None:
            return req
        requested = self.requested
        params = [p if p.max_tokens <= requested else dataclasses.replace(p, max_tokens=requested)
                  for p in req.params]
        return dataclasses.replace(req, params=params)

    def context_limited(self, req: GenerationRequest, max_tokens_limit: int | None) -> bool:
        """Whether the context (not the client, nor the server's cap) set this request's max_tokens."""
        caps = [x for x in (self.requested, max_tokens_limit) if x is not None]
        return not caps or req.params[0].max_tokens < min(caps)


class EventTranslator(Protocol):
    """A sans-IO translation of one generation's output events into an API's named stream events."""

    def start(self) -> list[dict[str, Any]]: ...

    def feed(self, events: Iterable[OutputEvent], usage: Usage | None = None) -> list[dict[str, Any]]: ...


T = TypeVar("T", bound=EventTranslator)


def named_events(events: Iterable[dict[str, Any]]) -> bytes:
    """SSE events each named by its `type` (as Anthropic's and the Responses streams are)."""
    return b"".join(sse_named_event(str(ev["type"]), ev) for ev in events)


class NamedEventStream(Generic[T]):
    """The event stream of one generation in an API with named events (a sse.StreamTranslator once a subclass
    gives its keepalive and its failure event)."""

    keepalive: bytes

    def __init__(self, translator: T, parser: ChoiceParser) -> None:
        self.translator = translator
        self.parser = parser

    def opening(self) -> bytes:
        return named_events(self.translator.start())

    def feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        """One delta through the parser and the translator (a non-streamed answer keeps only the latter's state)."""
        return self.translator.feed(self.parser.feed_output(out), out.usage)

    def outputs(self, outputs: list[RequestOutput]) -> bytes:
        return named_events([ev for out in outputs for ev in self.feed(out)])

    def closing(self) -> bytes:
        return b""  # the translator's last events came with the final output
