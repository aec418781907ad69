"""OpenAI wire format, responses: one generation's output events -> chat and text completion responses and chunks.

Each choice's deltas go through its `ChoiceParser` (web/chat/output_events.py), as on every other surface; a
text completion's parsing splits nothing, so its events are its text. Pure, no IO, except the SSE stream at
the end.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from trillm.engine.outputs import RequestOutput, TokenLogprob, Usage
from trillm.engine.tokenizer import TokenizerLike as Tokenizer
from trillm.web.chat.output_events import (
    ChoiceParser, OutputEnd, OutputEvent, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallStart,
)
from trillm.web.errors import to_api_error
from trillm.web.http.sse import DONE, KEEPALIVE, event_stream, sse_event
from trillm.web.openai.request import GenerationRequest
from trillm.web.service.stream import GenerationHandle


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(finish: OutputEnd | None) -> str | None:
    """OpenAI's finish_reason for a choice's end: stop, length, tool_calls, grammar or timeout (an abort or an
    engine error reads as stop; the error itself goes in stop_reason)."""
    if finish is None:
        return None
    return "stop" if finish.reason in ("abort", "error") else finish.reason


def _end_fields(finish: OutputEnd | None) -> dict[str, Any]:
    """A chat choice's finish_reason, and stop_reason with the error when its end has one."""
    fields: dict[str, Any] = {"finish_reason": finish_reason(finish)}
    if finish is not None and finish.error:
        fields["stop_reason"] = finish.error
    return fields


@dataclass(slots=True)
class _Choice:
    parser: ChoiceParser
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: OutputEnd | None = None
    usage: Usage | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    started: bool = False  # streaming: its first delta (which carries the echo) went out

    def apply(self, events: list[OutputEvent]) -> None:
        """Accumulate a choice's events (non-streaming)."""
        for ev in events:
            if isinstance(ev, TextDelta):
                self.text += ev.text
            elif isinstance(ev, ReasoningDelta):
                self.reasoning += ev.text
            elif isinstance(ev, ToolCallStart):
                self.tool_calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
            elif isinstance(ev, ToolCallArgumentsDelta):
                self.tool_calls[ev.index]["function"]["arguments"] += ev.delta


def event_delta(ev: OutputEvent) -> dict[str, Any] | None:
    """An event as OpenAI's streamed `delta` (None: nothing on the wire, e.g. a call's end)."""
    if isinstance(ev, TextDelta):
        return {"content": ev.text}
    if isinstance(ev, ReasoningDelta):
        return {"reasoning_content": ev.text, "reasoning": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, ToolCallArgumentsDelta):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.delta}}]}
    return None


Logprobs = tuple[TokenLogprob, ...] | list[TokenLogprob]


@dataclass(frozen=True, slots=True)
class StreamedDelta:
    """One engine delta of one choice, ready for the wire: its events, its text (a completion's first delta
    carries the echoed prompt) and its logprobs in the surface's format."""

    index: int
    events: list[OutputEvent]
    text: str
    logprobs: Any
    prompt_logprobs: list[dict[str, Any] | None] | None

    @property
    def finish(self) -> OutputEnd | None:
        return next((ev for ev in self.events if isinstance(ev, OutputEnd)), None)


class ResponseBuilder:
    """Accumulates one generation's output events per choice; `ChatResponseBuilder` and
    `CompletionResponseBuilder` render them as OpenAI's chat or text completions (see `response_builder`).

    Choice i belongs to prompt i // n (request_ids come prompt-major, see GenerationRequest).
    """

    id_prefix: str
    object: str
    chunk_object: str

    def __init__(self, req: GenerationRequest, request_ids: tuple[str, ...], tokenizer: Tokenizer) -> None:
        self.req = req
        self.n = len(req.params)
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.tokenizer = tokenizer
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice(ChoiceParser(req.parsing)) for _ in request_ids]

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        # An id past the tokenizer's vocabulary (a padded embedding row) renders as no bytes, never an error.
        raw = self.tokenizer.token_bytes(token_id) if 0 <= token_id < self.tokenizer.vocab_size else b""
        return raw.decode("utf-8", errors="replace"), list(raw)

    def prompt_logprobs_for(self, lps: tuple[TokenLogprob | None, ...] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token (None for the first), {token id: {logprob, rank,
        decoded_token}} for the token itself and its top alternatives."""
        k = self.req.prompt_logprobs
        if k is None or lps is None:
            return None
        out: list[dict[str, Any] | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self._token(lp.token_id)[0]}}
            for rank, (tid, val) in enumerate(lp.top[:k], 1):
                entry.setdefault(str(tid), {"logprob": val, "rank": rank, "decoded_token": self._token(tid)[0]})
            out.append(entry)
        return out

    def total_usage(self) -> Usage:
        """Each prompt counted once (its n choices share it), every choice's completion tokens."""
        prompt = completion = cached = 0
        for p, ids in enumerate(self.req.prompts):
            usages = [c.usage for c in self.choices[p * self.n : (p + 1) * self.n] if c.usage is not None]
            prompt += usages[0].prompt_tokens if usages else len(ids)
            completion += sum(u.completion_tokens for u in usages)
            cached += max((u.cached_tokens for u in usages), default=0)
        return Usage(prompt, completion, cached)

    def _feed(self, out: RequestOutput) -> tuple[int, list[OutputEvent]]:
        """One delta through its choice's parser: the choice's state (usage, finish), not its text."""
        i = self.index[out.request_id]
        c = self.choices[i]
        events = c.parser.feed_output(out)
        c.usage = out.usage
        c.finish = next((ev for ev in events if isinstance(ev, OutputEnd)), c.finish)
        return i, events

    # -- non-streaming --
    def add(self, out: RequestOutput) -> None:
        """Accumulate one delta of a non-streamed response."""
        i, events = self._feed(out)
        c = self.choices[i]
        c.apply(events)
        c.logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs

    def response(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.req.model,
                "choices": [self._choice(i, c) for i, c in enumerate(self.choices)],
                "usage": usage_dict(self.total_usage())}

    def _choice(self, i: int, c: _Choice) -> dict[str, Any]:
        raise NotImplementedError

    # -- streaming --
    def stream_delta(self, out: RequestOutput) -> StreamedDelta:
        raise NotImplementedError

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": self.chunk_object, "created": self.created,
                                 "model": self.req.model, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def delta_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        raise NotImplementedError

    def final_chunks(self) -> list[dict[str, Any]]:
        if not self.req.include_usage:
            return []
        chunk = self._chunk([])
        chunk["usage"] = usage_dict(self.total_usage())
        return [chunk]


class ChatResponseBuilder(ResponseBuilder):
    """OpenAI's chat completions: messages with content, reasoning and tool_calls; one chunk per event."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def logprobs_for(self, lps: Logprobs | None) -> dict[str, Any] | None:
        if not self.req.logprobs or lps is None:
            return None
        content = []
        for lp in lps:
            token, raw = self._token(lp.token_id)
            top = []
            for tid, val in lp.top:
                t, b = self._token(tid)
                top.append({"token": t, "logprob": val, "bytes": b})
            content.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def response(self) -> dict[str, Any]:
        resp = super().response()
        if self.req.prompt_logprobs is not None:
            resp["prompt_logprobs"] = self.prompt_logprobs_for(self.choices[0].prompt_logprobs)
        return resp

    def _choice(self, i: int, c: _Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.reasoning:
            message["reasoning_content"] = message["reasoning"] = c.reasoning
        if c.tool_calls:
            message["content"] = c.text if c.text.strip() else None
            message["tool_calls"] = c.tool_calls
        return {"index": i, "message": message, "logprobs": self.logprobs_for(c.logprobs), **_end_fields(c.finish)}

    def stream_delta(self, out: RequestOutput) -> StreamedDelta:
        i, events = self._feed(out)
        return StreamedDelta(i, events, "".join(ev.text for ev in events if isinstance(ev, TextDelta)),
                             self.logprobs_for(out.logprobs), self.prompt_logprobs_for(out.prompt_logprobs))

    def _delta_chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
                     finish: OutputEnd | None = None) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs, **_end_fields(finish)}])

    def first_chunks(self) -> list[dict[str, Any]]:
        """The role chunk of each choice."""
        return [self._delta_chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.choices))]

    def delta_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """One chunk per event, as OpenAI streams them; this delta's logprobs ride on its first chunk, and
        vLLM's prompt_logprobs on the choice's first."""
        d = self.stream_delta(out)
        chunks = []
        logprobs = d.logprobs if out.logprobs else None
        for ev in d.events:
            if (delta := event_delta(ev)) is not None:
                chunks.append(self._delta_chunk(d.index, delta, logprobs))
                logprobs = None
        if logprobs is not None:
            chunks.append(self._delta_chunk(d.index, {"content": ""}, logprobs))
        if d.finish is not None:
            chunks.append(self._delta_chunk(d.index, {}, finish=d.finish))
        if d.prompt_logprobs is not None:
            if not chunks:
                chunks.append(self._delta_chunk(d.index, {"content": ""}))
            chunks[0]["prompt_logprobs"] = d.prompt_logprobs
        return chunks


class CompletionResponseBuilder(ResponseBuilder):
    """OpenAI's legacy text completions: echo, and logprobs in their own format."""

    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"

    def __init__(self, req: GenerationRequest, request_ids: tuple[str, ...], tokenizer: Tokenizer) -> None:
        super().__init__(req, request_ids, tokenizer)
        self._text_offset = [0] * len(request_ids)

    def _logprobs(self, i: int, lps: Logprobs, *, echo: bool = False,
                  prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None) -> dict[str, Any]:
        """OpenAI's legacy format; with echo, the prompt's tokens come first (the first one's logprob null)."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        k = self.req.top_logprobs

        def put(token_id: int, lp: TokenLogprob | None) -> None:
            token, _ = self._token(token_id)
            tokens.append(token)
            values.append(None if lp is None else lp.logprob)
            top: dict[str, float] | None = None
            if lp is not None and lp.top[:k]:
                top = {}
                for tid, val in lp.top[:k]:  # best first: tokens whose text collides keep the likeliest
                    top.setdefault(self._token(tid)[0], val)
            tops.append(top)
            offsets.append(self._text_offset[i])
            self._text_offset[i] += len(token)

        if echo:
            for pos, token_id in enumerate(self.req.prompts[i // self.n]):
                put(token_id, prompt_logprobs[pos] if prompt_logprobs is not None else None)
        for lp in lps:
            put(lp.token_id, lp)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, i: int, c: _Choice) -> dict[str, Any]:
        text = self.req.echo_texts[i // self.n] + c.text if self.req.echo else c.text
        choice: dict[str, Any] = {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason(c.finish)}
        if self.req.logprobs:
            choice["logprobs"] = self._logprobs(i, c.logprobs, echo=self.req.echo, prompt_logprobs=c.prompt_logprobs)
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_for(c.prompt_logprobs)
        return choice

    def stream_delta(self, out: RequestOutput) -> StreamedDelta:
        i, events = self._feed(out)
        c = self.choices[i]
        first, c.started = not c.started, True
        echo = first and self.req.echo
        text = "".join(ev.text for ev in events if isinstance(ev, TextDelta))
        logprobs = None
        if self.req.logprobs and (echo or out.logprobs is not None):
            logprobs = self._logprobs(i, out.logprobs or (), echo=echo, prompt_logprobs=out.prompt_logprobs)
        return StreamedDelta(i, events, self.req.echo_texts[i // self.n] + text if echo else text, logprobs,
                             self.prompt_logprobs_for(out.prompt_logprobs))

    def delta_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        d = self.stream_delta(out)
        chunks = []
        if d.text or d.logprobs or d.prompt_logprobs is not None:
            choice: dict[str, Any] = {"index": d.index, "text": d.text, "logprobs": d.logprobs, "finish_reason": None}
            if d.prompt_logprobs is not None:
                choice["prompt_logprobs"] = d.prompt_logprobs
            chunks.append(self._chunk([choice]))
        if (finish := d.finish) is not None:
            chunks.append(self._chunk([{"index": d.index, "text": "", "logprobs": None,
                                        "finish_reason": finish_reason(finish)}]))
        return chunks


def response_builder(req: GenerationRequest, request_ids: tuple[str, ...], tokenizer: Tokenizer) -> ResponseBuilder:
    cls = ChatResponseBuilder if req.kind == "chat" else CompletionResponseBuilder
    return cls(req, request_ids, tokenizer)


class ChatChunks:
    """OpenAI's chat and text completion chunks."""

    keepalive = KEEPALIVE

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder

    def opening(self) -> bytes:
        return b"".join(sse_event(c) for c in self.builder.first_chunks())

    def outputs(self, outputs: list[RequestOutput]) -> bytes:
        return b"".join(sse_event(c) for out in outputs for c in self.builder.delta_chunks(out))

    def closing(self) -> bytes:
        return b"".join(sse_event(c) for c in self.builder.final_chunks()) + DONE

    def failure(self, exc: Exception) -> bytes:
        return sse_event(to_api_error(exc).body()) + DONE


def sse_stream(handle: GenerationHandle, builder: ResponseBuilder, *, keepalive_s: float) -> AsyncIterator[bytes]:
    """The OpenAI stream of one chat or text completion."""
    return event_stream(handle, ChatChunks(builder), keepalive_s=keepalive_s)
