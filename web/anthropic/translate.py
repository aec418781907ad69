"""Anthropic's Messages API as a translation, without IO: a Messages request -> the internal chat completion
body; one choice's output events -> a Message, or its named stream events; errors -> Anthropic's shape.

Stream order (Anthropic's): message_start; per content block content_block_start, content_block_delta
(text_delta, thinking_delta, input_json_delta)..., content_block_stop; message_delta (stop_reason, usage);
message_stop. `ping` while nothing else is sent; an `error` event when the generation fails mid-stream.

Usage follows Anthropic's accounting: input_tokens + cache_read_input_tokens + cache_creation_input_tokens is
the whole prompt; cache_read_input_tokens is what the prefix cache served; the prefix cache fills itself as
prompts are computed, so nothing is billed as cache creation (0).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from trillm.engine.errors import InvalidRequest
from trillm.engine.outputs import Usage
from trillm.web.anthropic.schema import (
    CountTokensRequest, Message as InputMessage, MessagesRequest, OtherBlock, RedactedThinkingBlock, TextBlock,
    ThinkingBlock, ThinkingDisabled, ToolChoiceAny, ToolChoiceNone, ToolChoiceTool, ToolResultBlock, ToolUseBlock,
)
from trillm.web.chat.output_events import (
    OutputEnd, OutputEvent, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart,
    arguments_object,
)
from trillm.web.errors import APIError, parse_object, to_api_error
from trillm.web.openai.schema import (
    ChatCompletionRequest, ChatMessage, FunctionDef, JsonSchemaFormat, NamedFunction, NamedToolChoice,
    ResponseFormat, Tool, ToolCall, ToolCallFunction,
)
from trillm.web.openai.translation import NamedEventStream, named_events

# Anthropic's defaults for what current SDKs no longer send.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0  # no nucleus filter
DEFAULT_TOP_K = 0  # no top-k filter

TEXT_ONLY = "this model takes text only"


# ---- request ----

def _refuse_block(block: OtherBlock, where: str) -> InvalidRequest:
    if block.type in ("image", "document"):
        return InvalidRequest(f"'{where}': {TEXT_ONLY} ({block.type} blocks are not supported)")
    return InvalidRequest(f"'{where}': content blocks of type {block.type!r} are not supported here (supported: text, "
                          "tool_use, tool_result, thinking, redacted_thinking)")


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for k, part in enumerate(block.content):
            if isinstance(part, OtherBlock):
                raise _refuse_block(part, f"{where}.content.{k}")
            parts.append(part.text)
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _conversation(messages: Sequence[InputMessage]) -> list[ChatMessage]:
    """Anthropic turns as chat messages: tool_use blocks become tool calls, tool_result blocks tool messages."""
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
            continue
        texts: list[str] = []
        calls: list[ToolCall] = []

        def flush_text() -> None:
            if texts:
                out.append(ChatMessage(role=message.role, content="".join(texts)))
                texts.clear()

        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise InvalidRequest(f"'{where}': tool_use blocks belong in assistant messages")
                calls.append(ToolCall(id=block.id, function=ToolCallFunction(
                    name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise InvalidRequest(f"'{where}': tool_result blocks belong in user messages")
                flush_text()
                out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                       content=_tool_result_text(block, where)))
            elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
                pass  # earlier turns' thinking: chat templates drop it from the prompt
            else:
                raise _refuse_block(block, where)
        if calls:
            out.append(ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls))
        else:
            flush_text()
    if messages[-1].role == "assistant":
        raise InvalidRequest("'messages': the last message is the assistant's (a prefill); continuing an assistant "
                             "turn is not supported, end with a user message")
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls of the internal body."""
    choice = body.tool_choice
    if not body.tools:
        if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)):
            raise InvalidRequest(f"'tool_choice': {choice.type!r} needs 'tools'")
        return {}
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(f"'tools.{i}': {tool.name!r} is a server tool (type {tool.type!r}); this server "
                                 "runs no tools of its own: give client tools (name, description, input_schema)")
        if tool.input_schema is None:
            raise InvalidRequest(f"'tools.{i}.input_schema': required")
        tools.append(Tool(type="function", function=FunctionDef(
            name=tool.name, description=tool.description, parameters=tool.input_schema)))
    fields: dict[str, Any] = {"tools": tools}
    if isinstance(choice, ToolChoiceNone):
        fields["tool_choice"] = "none"
    elif isinstance(choice, ToolChoiceAny):
        fields["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    elif choice is not None:
        fields["tool_choice"] = "auto"
    if choice is not None and not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def chat_body(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The internal chat completion body of a Messages request (max_tokens is left to FitMaxTokens)."""
    messages: list[ChatMessage] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        messages.append(ChatMessage(role="system", content=system))
    messages += _conversation(body.messages)
    fields: dict[str, Any] = {"messages": messages, **_tools(body)}
    if body.output_config is not None and body.output_config.format is not None:
        # Anthropic's structured outputs are guaranteed: the schema is enforced strictly.
        fields["response_format"] = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name="output", schema=body.output_config.format.schema_, strict=True))
    # Thinking is off unless asked for, as on Anthropic's API; templates that can think (Qwen3, ...) read
    # enable_thinking, others ignore it. The thinking itself comes back in thinking blocks.
    thinking = body.thinking is not None and not isinstance(body.thinking, ThinkingDisabled)
    fields["chat_template_kwargs"] = {"enable_thinking": thinking}
    if isinstance(body, MessagesRequest):
        fields.update(
            stream=body.stream, stop=list(body.stop_sequences) or None,
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
            top_k=DEFAULT_TOP_K if body.top_k is None else body.top_k, cache_salt=body.cache_salt,
        )
    return parse_object(ChatCompletionRequest, fields)


# ---- response ----

def usage_json(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


# A streamed block of each kind as it starts (its text then grows delta by delta).
_NEW_BLOCKS: dict[str, dict[str, Any]] = {"text": {"type": "text", "text": "", "citations": None},
                                          "thinking": {"type": "thinking", "thinking": "", "signature": ""}}


class MessageTranslator:
    """One choice's output events -> Anthropic's stream events, and the Message they add up to."""

    def __init__(self, *, model: str, prompt_tokens: int, stop_sequences: Sequence[str] = (),
                 context_limited: bool = False) -> None:
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.stop_sequences = frozenset(stop_sequences)
        self.context_limited = context_limited  # the context, not max_tokens, bounded this generation
        self.usage = Usage(prompt_tokens, 0, 0)
        self.content: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self._open: int | None = None  # index of the block being streamed
        self._tool_blocks: dict[int, int] = {}  # tool call index -> block index

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": usage_json(self.usage)}

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self._message([])}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

    def _begin(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.content.append(block)
        self._open = len(self.content) - 1
        # A copy: the block's text grows in self.content, its start event stays as it was sent.
        return events + [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _open_type(self) -> str | None:
        return None if self._open is None else str(self.content[self._open]["type"])

    def feed(self, events: Iterable[OutputEvent], usage: Usage | None = None) -> list[dict[str, Any]]:
        """Stream events for `events` (usage: the generation's so far, for the final message_delta)."""
        if usage is not None:
            self.usage = usage
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, OutputEnd):
                out += self._finish(ev)
            elif isinstance(ev, (TextDelta, ReasoningDelta)) and ev.text:
                kind = "text" if isinstance(ev, TextDelta) else "thinking"
                if self._open_type() != kind:
                    out += self._begin(dict(_NEW_BLOCKS[kind]))
                assert self._open is not None
                self.content[self._open][kind] += ev.text
                out.append({"type": "content_block_delta", "index": self._open,
                            "delta": {"type": f"{kind}_delta", kind: ev.text}})
            elif isinstance(ev, ToolCallStart):
                out += self._begin({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
                assert self._open is not None
                self._tool_blocks[ev.index] = self._open
            elif isinstance(ev, ToolCallArgumentsDelta):
                if ev.delta and ev.index in self._tool_blocks:
                    out.append({"type": "content_block_delta", "index": self._tool_blocks[ev.index],
                                "delta": {"type": "input_json_delta", "partial_json": ev.delta}})
            elif isinstance(ev, ToolCallEnd):
                block = self._tool_blocks.get(ev.index)
                if block is None:
                    continue
                try:
                    self.content[block]["input"] = arguments_object(ev.arguments)
                except ValueError:
                    self.content[block]["input"] = {}
                if self._open == block:
                    out += self._close()
        return out

    def _finish(self, finish: OutputEnd) -> list[dict[str, Any]]:
        """Close the open block; message_delta (stop reason, final usage) and message_stop."""
        if finish.reason == "length":
            self.stop_reason = "model_context_window_exceeded" if self.context_limited else "max_tokens"
        elif isinstance(finish.stop_reason, str) and finish.stop_reason in self.stop_sequences:
            self.stop_reason, self.stop_sequence = "stop_sequence", finish.stop_reason
        elif finish.reason == "tool_calls":
            self.stop_reason = "tool_use"
        elif finish.reason == "timeout":
            # Its deadline passed. Anthropic's stop reasons are a closed set that clients switch on; a budget that
            # ran out is max_tokens's meaning (the output is cut, not finished), so clients treat it as truncated.
            self.stop_reason = "max_tokens"
        else:  # "stop", or "grammar" (the constrained output could not go on: it ends here)
            self.stop_reason = "end_turn"
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
             "usage": usage_json(self.usage)},
            {"type": "message_stop"},
        ]

    def message(self) -> dict[str, Any]:
        """The whole Message (after finish)."""
        return self._message(self.content)


# ---- errors ----

MESSAGES_PATH = "/v1/messages"  # errors on it and below it take Anthropic's shape
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
OVERLOADED_STATUS = 529


def anthropic_error(err: APIError) -> tuple[int, dict[str, Any]]:
    """Anthropic's status and body for an error: a full queue is 529 overloaded_error."""
    status = OVERLOADED_STATUS if err.code == "overloaded" else err.status
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": err.message}}


# ---- stream ----

PING = named_events([{"type": "ping"}])


class MessagesStream(NamedEventStream[MessageTranslator]):
    """The event stream of one Messages generation (a sse.StreamTranslator)."""

    keepalive = PING

    def failure(self, exc: Exception) -> bytes:
        _, body = anthropic_error(to_api_error(exc))
        return named_events([body])
