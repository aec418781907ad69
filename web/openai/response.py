"""OpenAI wire format, responses: one generation's deltas -> chat and text completion responses and chunks.

Pure functions and small records, no IO, so every rule here is testable without a server.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from trillm.engine.outputs import FinishReason, RequestOutput, TokenLogprob, Usage
from trillm.engine.tokenizer import TokenizerLike as Tokenizer
from trillm.web.chat.output_events import (
    ChoiceParser, Finish, OutputEvent, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallStart,
)
from collections.abc import AsyncIterator

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


def _finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    if reason is FinishReason.GRAMMAR:
        return "grammar"
    if reason is FinishReason.TIMEOUT:  # the request's deadline (--request-timeout, X-Request-Timeout) passed
        return "timeout"
    return "length" if reason is FinishReason.LENGTH else "stop"


@dataclass(slots=True)
class _Choice:
    parser: ChoiceParser
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    finish: Finish | None = None
    usage: Usage | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    started: bool = False  # streaming: its first delta (which carries the echo) went out

    def apply(self, events: list[OutputEvent]) -> None:
        """Accumulate a chat choice's events (non-streaming)."""
        for ev in events:
            if isinstance(ev, TextDelta):
                self.text += ev.text
            elif isinstance(ev, ReasoningDelta):
                self.reasoning += ev.text
            elif isinstance(ev, ToolCallStart):
                self.tool_calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
            elif isinstance(ev, ToolCallArgumentsDelta):
                self.tool_calls[ev.index]["function"]["arguments"] += ev.delta
            elif isinstance(ev, Finish):
                self.finish = ev


def _chat_finish_reason(finish: Finish | None, reason: FinishReason | None) -> str | None:
    if finish is not None:
        return "stop" if finish.reason in ("abort", "error") else finish.reason
    return _finish_reason(reason)


def _event_delta(ev: OutputEvent) -> dict[str, Any] | None:
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


class ResponseBuilder:
    """Accumulates one generation's deltas and renders OpenAI responses and stream chunks.

    Choice i belongs to prompt i // n (request_ids come prompt-major, see GenerationRequest).
    """

    def __init__(self, req: GenerationRequest, request_ids: tuple[str, ...], tokenizer: Tokenizer) -> None:
        self.req = req
        self.n = len(req.params)
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if req.kind == "chat" else "text_completion"
        self.choices = [_Choice(ChoiceParser(req.parsing)) for _ in request_ids]
        self._text_offset = [0] * len(request_ids)

    # -- logprobs in both formats --
    def _token(self, token_id: int) -> tuple[str, list[int]]:
        # An id past the tokenizer's vocabulary (a padded embedding row) renders as no bytes, never an error.
        raw = self.tokenizer.token_bytes(token_id) if 0 <= token_id < self.tokenizer.vocab_size else b""
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, lps: Logprobs) -> dict[str, Any]:
        content = []
        for lp in lps:
            token, raw = self._token(lp.token_id)
            top = []
            for tid, val in lp.top:
                t, b = self._token(tid)
                top.append({"token": t, "logprob": val, "bytes": b})
            content.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, i: int, lps: Logprobs, *, echo: bool = False,
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

    def logprobs_for(self, i: int, lps: Logprobs | None) -> Any:
        if not self.req.logprobs or lps is None:
            return None
        return self._chat_logprobs(lps) if self.req.kind == "chat" else self._completion_logprobs(i, lps)

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

    # -- non-streaming --
    def add(self, out: RequestOutput, *, keep: bool = True) -> int:
        """Account for one delta; keep=False (streaming) keeps only its state, not its text or logprobs."""
        return self._add(out, keep)[0]

    def _add(self, out: RequestOutput, keep: bool) -> tuple[int, list[OutputEvent]]:
        i = self.index[out.request_id]
        c = self.choices[i]
        events: list[OutputEvent] = []
        if self.req.kind == "chat":
            events = c.parser.feed(out.new_text)
            if out.finish_reason is not None:
                events += c.parser.finish(out.finish_reason, stop_reason=out.stop_reason, error=out.error)
        if keep:
            if self.req.kind == "chat":
                c.apply(events)
            else:
                c.text += out.new_text
            if out.logprobs:
                c.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
        elif events and isinstance(events[-1], Finish):
            c.finish = events[-1]
        c.usage = out.usage
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason
        return i, events

    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            if self.req.kind == "chat":
                logprobs = self.logprobs_for(i, c.logprobs)
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                if c.reasoning:
                    message["reasoning_content"] = message["reasoning"] = c.reasoning
                if c.tool_calls:
                    message["content"] = c.text if c.text.strip() else None
                    message["tool_calls"] = c.tool_calls
                choice: dict[str, Any] = {"index": i, "message": message, "logprobs": logprobs,
                                          "finish_reason": _chat_finish_reason(c.finish, c.finish_reason)}
                if c.finish is not None and c.finish.error:
                    choice["stop_reason"] = c.finish.error
                choices.append(choice)
                continue
            choice = {"index": i, "text": c.text, "logprobs": None, "finish_reason": _finish_reason(c.finish_reason)}
            if self.req.echo:
                choice["text"] = self.req.echo_texts[i // self.n] + c.text
            if self.req.logprobs:
                choice["logprobs"] = self._completion_logprobs(i, c.logprobs, echo=self.req.echo,
                                                               prompt_logprobs=c.prompt_logprobs)
            if self.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs_for(c.prompt_logprobs)
            choices.append(choice)
        resp = {"id": self.id, "object": self.object, "created": self.created, "model": self.req.model,
                "choices": choices, "usage": usage_dict(self.total_usage())}
        if self.req.kind == "chat" and self.req.prompt_logprobs is not None:
            resp["prompt_logprobs"] = self.prompt_logprobs_for(self.choices[0].prompt_logprobs)
        return resp

    # -- streaming --
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object + ("" if self.req.kind == "completion" else ".chunk"),
                                 "created": self.created, "model": self.req.model, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunks(self) -> list[dict[str, Any]]:
        """The role chunk of each chat choice (completions have none)."""
        if self.req.kind != "chat":
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.choices))]

    def stream_delta(self, out: RequestOutput) -> tuple[int, str, Any, list[dict[str, Any] | None] | None]:
        """One streamed delta as (choice index, text, logprobs, prompt_logprobs); a completion choice's first
        delta carries the echoed prompt before its own text, and the prompt's logprobs (when asked for)."""
        i = self.add(out, keep=False)
        if self.req.kind == "chat":
            return i, out.new_text, self.logprobs_for(i, out.logprobs), self.prompt_logprobs_for(out.prompt_logprobs)
        c = self.choices[i]
        first, c.started = not c.started, True
        echo = first and self.req.echo
        text = self.req.echo_texts[i // self.n] + out.new_text if echo else out.new_text
        logprobs = None
        if self.req.logprobs and (echo or out.logprobs is not None):
            logprobs = self._completion_logprobs(i, out.logprobs or (), echo=echo, prompt_logprobs=out.prompt_logprobs)
        return i, text, logprobs, self.prompt_logprobs_for(out.prompt_logprobs)

    def delta_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        if self.req.kind == "chat":
            i, events = self._add(out, keep=False)
            chunks = self._chat_chunks(i, out, events)
            prompt_logprobs = self.prompt_logprobs_for(out.prompt_logprobs)
            if prompt_logprobs is not None:  # vLLM's field, on the choice's first chunk
                if not chunks:
                    chunks.append(self._chunk([{"index": i, "delta": {"content": ""}, "logprobs": None,
                                                "finish_reason": None}]))
                chunks[0]["prompt_logprobs"] = prompt_logprobs
            return chunks
        i, text, logprobs, prompt_logprobs = self.stream_delta(out)
        chunks = []
        if text or logprobs or prompt_logprobs is not None:
            choice: dict[str, Any] = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            chunks.append(self._chunk([choice]))
        if out.finish_reason is not None:
            chunks.append(self._chunk([{"index": i, "text": "", "logprobs": None,
                                        "finish_reason": _finish_reason(out.finish_reason)}]))
        return chunks

    def _chat_chunks(self, i: int, out: RequestOutput, events: list[OutputEvent]) -> list[dict[str, Any]]:
        """One chunk per event, as OpenAI streams them; this delta's logprobs ride on its first chunk."""
        chunks = []
        logprobs = self.logprobs_for(i, out.logprobs) if out.logprobs else None
        for ev in events:
            delta = _event_delta(ev)
            if delta is not None:
                chunks.append(self._chunk([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}]))
                logprobs = None
        if logprobs is not None:
            chunks.append(self._chunk([{"index": i, "delta": {"content": ""}, "logprobs": logprobs,
                                        "finish_reason": None}]))
        finish = next((ev for ev in events if isinstance(ev, Finish)), None)
        if finish is not None:
            choice: dict[str, Any] = {"index": i, "delta": {}, "logprobs": None,
                                      "finish_reason": _chat_finish_reason(finish, out.finish_reason)}
            if finish.error:
                choice["stop_reason"] = finish.error
            chunks.append(self._chunk([choice]))
        return chunks

    def final_chunks(self) -> list[dict[str, Any]]:
        if not self.req.include_usage:
            return []
        chunk = self._chunk([])
        chunk["usage"] = usage_dict(self.total_usage())
        return [chunk]


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
