"""What the Messages and Responses translations share, around the one generation path of chat completions.

Both APIs translate their request into the internal chat completion body (openai_schema.ChatCompletionRequest),
so templates, tools, grammars and usage are chat completions' own; and both render the same per-choice output
events (output_events.py) in their own wire format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trillm.engine.outputs import RequestOutput
from trillm.web.output_events import ChoiceParser, OutputEvent
from trillm.web.protocol import GenerationRequest


def choice_events(parser: ChoiceParser, out: RequestOutput) -> list[OutputEvent]:
    """One delta of a choice as its output events; the last delta's events end with the one `Finish`."""
    events = parser.feed(out.new_text)
    if out.finish_reason is not None:
        events += parser.finish(out.finish_reason, stop_reason=out.stop_reason, error=out.error)
    return events


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
