"""The Responses API translation without a server: request bodies -> the internal chat body; output events ->
typed stream events with sequence numbers, checked against the official openai SDK's types and its own stream
state machine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from openai import omit
from pydantic import TypeAdapter

from trillm.engine.errors import InvalidRequest
from trillm.engine.outputs import Usage
from trillm.web.chat.output_events import (
    OutputEnd, OutputEvent, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart,
)
from trillm.web.errors import parse_body
from trillm.web.openai.schema import NamedToolChoice
from trillm.web.responses.schema import ResponsesRequest
from trillm.web.responses.translate import ResponseTranslator, chat_body


def body(**fields: Any) -> ResponsesRequest:
    return parse_body(ResponsesRequest, json.dumps({"model": "m", "input": "hello", **fields}))


def chat(**fields: Any) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in chat_body(body(**fields)).messages]


def test_input_string_and_instructions() -> None:
    assert chat() == [{"role": "user", "content": "hello"}]
    assert chat(instructions="be brief") == [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hello"}]


def test_input_items_make_the_conversation() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking.",
                                                             "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    assert chat(input=items) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"},
    ]


@pytest.mark.parametrize("fields, message", [
    ({"store": True}, "stateless"),
    ({"previous_response_id": "resp_1"}, "stateless"),
    ({"conversation": "conv_1"}, "stateless"),
    ({"background": True}, "stateless"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "stateless"),
    ({"tools": [{"type": "web_search"}]}, "built-in tool.*stateless"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "built-in tool.*stateless"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:..."}]}]}, "text only"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]}, "text only"),
    ({"input": [{"type": "local_shell_call", "id": "x"}]}, "'local_shell_call' are not supported"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "custom"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}}, "allowed_tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
])
def test_refused_with_a_clear_message(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        chat_body(body(**fields))


def test_accepted_and_mapped() -> None:
    internal = chat_body(body(store=False, temperature=0.2, top_p=0.5, reasoning={"effort": "low"},
                              include=["reasoning.encrypted_content"], metadata={"k": "v"}, truncation="disabled",
                              tools=[{"type": "function", "name": "f", "parameters": {"type": "object"},
                                      "strict": True}], tool_choice="auto", parallel_tool_calls=False, stream=True))
    assert (internal.temperature, internal.top_p, internal.stream) == (0.2, 0.5, True)
    assert internal.tools is not None and internal.tools[0].function.name == "f"
    assert internal.tool_choice == "auto" and internal.parallel_tool_calls is False
    assert internal.chat_template_kwargs == {"enable_thinking": True}
    defaults = chat_body(body())
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (1.0, 1.0, None)
    assert defaults.chat_template_kwargs is None and defaults.response_format is None
    assert chat_body(body(reasoning={"effort": "none"})).chat_template_kwargs == {"enable_thinking": False}
    tools = [{"type": "function", "name": "f", "parameters": None, "strict": None}]
    assert chat_body(body(tools=tools, tool_choice="none")).tool_choice == "none"
    assert chat_body(body(tools=tools, tool_choice="required")).tool_choice == "required"
    named = chat_body(body(tools=tools, tool_choice={"type": "function", "name": "f"})).tool_choice
    assert isinstance(named, NamedToolChoice) and named.function.name == "f"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = chat_body(body(text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                          "strict": True}})).response_format
    assert fmt is not None and fmt.json_schema is not None
    assert (fmt.type, fmt.json_schema.name, fmt.json_schema.schema_, fmt.json_schema.strict) == (
        "json_schema", "thing", schema, True)
    obj = chat_body(body(text={"format": {"type": "json_object"}})).response_format
    assert obj is not None and obj.type == "json_object"


@pytest.mark.parametrize("fields", [
    {"input": []}, {"input": 5}, {"max_output_tokens": 0}, {"temperature": 3}, {"store": "yes"},
    {"input": [{"role": "robot", "content": "x"}]}, {"tool_choice": "sometimes"},
    {"text": {"format": {"type": "xml"}}},
])
def test_invalid_bodies_are_400(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        parse_body(ResponsesRequest, json.dumps({"model": "m", "input": "hi", **fields}))


# ---- output ----

EVENTS: list[OutputEvent] = [
    ReasoningDelta("thinking "), ReasoningDelta("hard"), TextDelta("Let me "), TextDelta("check."),
    ToolCallStart(0, "call_a", "get_weather"), ToolCallArgumentsDelta(0, '{"city": '),
    ToolCallArgumentsDelta(0, '"Paris"}'), ToolCallEnd(0, '{"city": "Paris"}'),
]
STREAM = TypeAdapter(ResponseStreamEvent)


def run(events: list[OutputEvent], finish: OutputEnd | None, usage: Usage = Usage(40, 9, 32),
        **fields: Any) -> tuple[ResponseTranslator, list[dict[str, Any]]]:
    t = ResponseTranslator(body(**fields), model="m", prompt_tokens=40)
    out = t.start()
    for ev in events:
        out += t.feed([ev], Usage(40, 1, usage.cached_tokens))
    out += t.feed([finish], usage) if finish is not None else t.fail("generation_failed", "boom")
    return t, out


def replay(events: list[dict[str, Any]]) -> ResponseStreamState[Any]:
    """The official SDK's stream state machine over our events (it raises on any out-of-order event)."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for ev in events:
        state.handle_event(STREAM.validate_python(json.loads(json.dumps(ev))))
    return state


def test_stream_events_are_ordered_numbered_and_add_up_to_the_response() -> None:
    t, events = run(EVENTS, OutputEnd("tool_calls", 2))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.get("output_index") for e in events[2:-1]] == [0] * 7 + [1] * 7 + [2] * 5
    final = Response.model_validate(t.response())
    assert final.status == "completed" and final.output_text == "Let me check."
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert call.type == "function_call" and (call.call_id, call.name, call.arguments) == (
        "call_a", "get_weather", '{"city": "Paris"}')
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens) == (40, 9)
    assert final.usage.input_tokens_details.cached_tokens == 32
    state = replay(events)
    completed = state._completed_response
    assert completed is not None and completed.output_text == "Let me check."
    assert completed.to_dict(exclude_none=True) == final.to_dict(exclude_none=True)


def test_max_output_tokens_is_incomplete() -> None:
    t, events = run([TextDelta("partial")], OutputEnd("length"), Usage(40, 5, 0), max_output_tokens=5)
    assert events[-1]["type"] == "response.incomplete"
    final = Response.model_validate(t.response())
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens" and final.output[0].status == "incomplete"
    replay(events)


def test_failure_is_an_error_event_then_response_failed() -> None:
    t, events = run([TextDelta("part")], None)
    assert [e["type"] for e in events[-5:]] == ["error", "response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "failed" and final.error is not None and final.error.message == "boom"
    replay(events)


def test_a_grammar_that_cannot_go_on_fails_the_response() -> None:
    t, events = run([TextDelta('{"a": ')], OutputEnd("grammar", error="no token allowed"))
    assert events[-1]["type"] == "response.failed"
    final = Response.model_validate(t.response())
    assert final.status == "failed" and final.error is not None and "no token allowed" in final.error.message
    assert final.output_text == '{"a": '
    replay(events)


def test_empty_answer_has_no_output_items() -> None:
    t, events = run([], OutputEnd("stop", 2), Usage(40, 1, 0))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert t.response()["output"] == []
