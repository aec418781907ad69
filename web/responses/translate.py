"""OpenAI's Responses API (stateless) as a translation, without IO: a Responses request -> the internal chat
completion body; one choice's output events -> a Response, or its typed stream events.

Stream order (OpenAI's): response.created, response.in_progress; per output item response.output_item.added,
then for a message response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done (a reasoning item the same with reasoning_text), for a function call
response.function_call_arguments.delta..., response.function_call_arguments.done; response.output_item.done;
finally response.completed (or response.incomplete when max_output_tokens or the context ran out). A
failure is an `error` event, then response.failed. Every event carries a `sequence_number` from 0.

Usage follows OpenAI's accounting: input_tokens is the whole prompt, of which input_tokens_details.cached_tokens
came from the prefix cache.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from copy import deepcopy
from typing import Any

from trillm.engine.errors import InvalidRequest
from trillm.engine.outputs import Usage
from trillm.web.chat.output_events import (
    OutputEnd, OutputEvent, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart,
)
from trillm.web.errors import parse_object, to_api_error
from trillm.web.http.sse import KEEPALIVE
from trillm.web.openai.schema import (
    ChatCompletionRequest, ChatMessage, FunctionDef, JsonSchemaFormat, NamedFunction, NamedToolChoice,
    ResponseFormat, Tool, ToolCall, ToolCallFunction,
)
from trillm.web.openai.translation import NamedEventStream, named_events
from trillm.web.responses.schema import (
    FunctionCallItem, FunctionCallOutputItem, FunctionTool, MessageItem, OtherPart, ReasoningItem, RefusalPart,
    ResponsesRequest, TextPart,
)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's defaults
DEFAULT_TOP_P = 1.0
STATELESS = "this server is stateless"


# ---- request ----

def _refuse_stateful(body: ResponsesRequest) -> None:
    if body.store:
        raise InvalidRequest(f"'store': true is not supported: {STATELESS} and keeps no responses (send store: false)")
    if body.previous_response_id is not None:
        raise InvalidRequest(f"'previous_response_id' is not supported: {STATELESS}; send the whole conversation as "
                             f"'input'")
    if body.conversation is not None:
        raise InvalidRequest(f"'conversation' is not supported: {STATELESS}; send the whole conversation as 'input'")
    if body.prompt is not None:
        raise InvalidRequest(f"'prompt' (a stored prompt template) is not supported: {STATELESS}")
    if body.background:
        raise InvalidRequest(f"'background': true is not supported: {STATELESS}")
    if body.top_logprobs:
        raise InvalidRequest("'top_logprobs' is not supported")


def _parts_text(parts: str | list[TextPart | RefusalPart | OtherPart], where: str) -> str:
    if isinstance(parts, str):
        return parts
    texts = []
    for k, part in enumerate(parts):
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, RefusalPart):
            texts.append(part.refusal)
        else:
            raise InvalidRequest(f"'{where}.{k}': this model takes text only ({part.type!r} content is not supported)")
    return "".join(texts)


def _conversation(body: ResponsesRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        out.append(ChatMessage(role="user", content=body.input))
        return out
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role  # chat templates know no developer role
            out.append(ChatMessage(role=role, content=_parts_text(item.content, f"{where}.content")))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # one assistant turn: its text and all its calls
                out[-1] = ChatMessage(role="assistant", content=last.content,
                                      tool_calls=[*(last.tool_calls or []), call])
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_parts_text(item.output, f"{where}.output")))
        elif isinstance(item, ReasoningItem):
            pass  # earlier turns' reasoning: chat templates drop it from the prompt
        elif item.type == "item_reference":
            raise InvalidRequest(f"'{where}': item references are not supported: {STATELESS}; send the items "
                                 f"themselves")
        else:
            raise InvalidRequest(f"'{where}': input items of type {item.type!r} are not supported (supported: message, "
                                 "function_call, function_call_output, reasoning)")
    return out


def _tools(body: ResponsesRequest) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls of the internal body."""
    fields: dict[str, Any] = {}
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str) and (choice.type != "function" or choice.name is None):
        raise InvalidRequest(f"'tool_choice': {choice.type!r} is not supported (give 'none', 'auto', 'required' or "
                             "{'type': 'function', 'name': ...})")
    if not body.tools:
        return fields
    tools = []
    for i, tool in enumerate(body.tools):
        if not isinstance(tool, FunctionTool) and tool.type == "custom":
            raise InvalidRequest(f"'tools.{i}': custom (free-form input) tools are not supported; give function tools")
        if not isinstance(tool, FunctionTool):
            raise InvalidRequest(f"'tools.{i}': {tool.type!r} is a built-in tool: {STATELESS} and runs no tools of its "
                                 "own; give function tools")
        tools.append(Tool(type="function", function=FunctionDef(name=tool.name, description=tool.description,
                                                                parameters=tool.parameters, strict=tool.strict)))
    fields["tools"] = tools
    if isinstance(choice, str):
        fields["tool_choice"] = choice
    elif choice is not None and choice.name is not None:
        fields["tool_choice"] = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return fields


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise InvalidRequest("'text.format.schema' is required for type 'json_schema'")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name or "response", description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    """The internal chat completion body of a Responses request (max_output_tokens is left to FitMaxTokens)."""
    _refuse_stateful(body)
    fields: dict[str, Any] = {"messages": _conversation(body), **_tools(body),
                              "response_format": _response_format(body)}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:  # templates that can think (Qwen3, ...) read enable_thinking, others ignore it
        fields["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    fields.update(stream=body.stream, cache_salt=body.cache_salt,
                  temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                  top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p)
    return parse_object(ChatCompletionRequest, fields)


# ---- response ----

def usage_json(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens}


def _tools_json(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
             "strict": t.strict} for t in body.tools or () if isinstance(t, FunctionTool)]


# The one text part of a message and of a reasoning item, as it starts.
_TEXT_PARTS: dict[str, dict[str, Any]] = {
    "message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
    "reasoning": {"type": "reasoning_text", "text": ""}}


class ResponseTranslator:
    """One choice's output events -> the Responses stream events, and the Response they add up to. Events carry
    deep copies of the items: what was sent must not change as its item grows."""

    def __init__(self, body: ResponsesRequest, *, model: str, prompt_tokens: int) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.body = body
        self.model = model
        self.usage = Usage(prompt_tokens, 0, 0)
        self.status = "in_progress"
        self.incomplete_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._open: int | None = None  # output index of the item being streamed
        self._calls: dict[int, int] = {}  # tool call index -> output index

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def response(self) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        text_format: dict[str, Any] = {"type": "text"} if fmt is None else fmt.model_dump(
            by_alias=True, exclude_none=True)
        tool_choice: Any = b.tool_choice if b.tool_choice is None or isinstance(b.tool_choice, str) else \
            b.tool_choice.model_dump(exclude_none=True)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": False, "error": self.error,
            "incomplete_details": None if self.incomplete_reason is None else {"reason": self.incomplete_reason},
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": deepcopy(self.output),
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None,
                          "summary": b.reasoning.summary if b.reasoning else None},
            "store": False,
            "temperature": DEFAULT_TEMPERATURE if b.temperature is None else b.temperature,
            "text": {"format": text_format}, "tool_choice": tool_choice or "auto", "tools": _tools_json(b),
            "top_p": DEFAULT_TOP_P if b.top_p is None else b.top_p, "truncation": b.truncation or "disabled",
            "usage": None if self.status == "in_progress" else usage_json(self.usage),
            "user": b.user, "metadata": b.metadata or {},
        }

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    # -- items --
    def _open_kind(self) -> str | None:
        return None if self._open is None else str(self.output[self._open]["type"])

    def _text_event(self, index: int, step: str, **fields: Any) -> dict[str, Any]:
        """response.output_text.<step> of a message, or response.reasoning_text.<step> of a reasoning item."""
        item = self.output[index]
        if item["type"] == "message":
            fields["logprobs"] = []
        return self._event(f"response.{item['content'][0]['type']}.{step}", item_id=item["id"], output_index=index,
                           content_index=0, **fields)

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self.output.append(item)
        self._open = index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=deepcopy(item)))
        if item["type"] in _TEXT_PARTS:
            item["content"].append(deepcopy(_TEXT_PARTS[item["type"]]))
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=deepcopy(item["content"][0])))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.output[index]
        item["status"] = status
        events = []
        if item["type"] in _TEXT_PARTS:
            part = item["content"][0]
            events += [self._text_event(index, "done", text=part["text"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=deepcopy(part))]
        elif item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=deepcopy(item)))
        return events

    def feed(self, events: Iterable[OutputEvent], usage: Usage | None = None) -> list[dict[str, Any]]:
        """Stream events for `events` (usage: the generation's so far, for the final response)."""
        if usage is not None:
            self.usage = usage
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, OutputEnd):
                out += self._finish(ev)
            elif isinstance(ev, TextDelta) and ev.text:
                if self._open_kind() != "message":
                    out += self._add({"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                                      "role": "assistant", "content": []})
                out += self._add_text(ev.text)
            elif isinstance(ev, ReasoningDelta) and ev.text:
                if self._open_kind() != "reasoning":
                    out += self._add({"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "status": "in_progress",
                                      "summary": [], "content": []})
                out += self._add_text(ev.text)
            elif isinstance(ev, ToolCallStart):
                out += self._add({"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                                  "call_id": ev.id, "name": ev.name, "arguments": ""})
                assert self._open is not None
                self._calls[ev.index] = self._open
            elif isinstance(ev, ToolCallArgumentsDelta):
                index = self._calls.get(ev.index)
                if ev.delta and index is not None:
                    item = self.output[index]
                    item["arguments"] += ev.delta
                    out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=index, delta=ev.delta))
            elif isinstance(ev, ToolCallEnd):
                index = self._calls.get(ev.index)
                if index is not None:
                    self.output[index]["arguments"] = ev.arguments
                    if self._open == index:
                        out += self._close("completed")
        return out

    def _add_text(self, text: str) -> list[dict[str, Any]]:
        assert self._open is not None
        self.output[self._open]["content"][0]["text"] += text
        return [self._text_event(self._open, "delta", delta=text)]

    def _finish(self, finish: OutputEnd) -> list[dict[str, Any]]:
        if finish.reason in ("length", "timeout"):  # a timeout (its deadline passed) cuts short as a budget does
            self.status = "incomplete"
            self.incomplete_reason = "max_output_tokens" if finish.reason == "length" else "timeout"
        elif finish.reason == "grammar":  # the constrained output could not go on: not a valid answer
            self.status = "failed"
            self.error = {"code": "server_error",
                          "message": f"the output could not continue under its format: {finish.error or 'unknown'}"}
        else:
            self.status = "completed"
        out = self._close("completed" if self.status == "completed" else "incomplete")
        return out + [self._event(f"response.{self.status}", response=self.response())]

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        out = [self._event("error", code=code, message=message, param=None)]
        out += self._close("incomplete")
        # A Response's error.code is one of OpenAI's fixed codes; a failure mid-generation is the server's.
        self.status, self.error = "failed", {"code": "server_error", "message": message}
        return out + [self._event("response.failed", response=self.response())]


# ---- stream ----

class ResponsesStream(NamedEventStream[ResponseTranslator]):
    """The event stream of one Responses generation (a sse.StreamTranslator)."""

    keepalive = KEEPALIVE

    def failure(self, exc: Exception) -> bytes:
        err = to_api_error(exc)
        return named_events(self.translator.fail(err.code or "server_error", err.message))
