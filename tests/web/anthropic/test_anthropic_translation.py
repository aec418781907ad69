"""The Messages API translation without a server: request bodies -> the internal chat body and prompt; output
events -> Anthropic's stream events, checked against the official SDK's own types and stream accumulator."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from trillm.engine.admission import RequestLimits
from trillm.engine.errors import InvalidRequest, Overloaded
from trillm.engine.mock.tokenizer import MockTokenizer
from trillm.engine.outputs import Usage
from trillm.web.anthropic.schema import CountTokensRequest, MessagesRequest
from trillm.web.anthropic.translate import MessageTranslator, anthropic_error, chat_body
from trillm.web.chat.output_events import (
    OutputEnd, OutputEvent, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart,
)
from trillm.web.errors import APIError, parse_body, to_api_error
from trillm.web.openai.request import Limits, parse_generation
from trillm.web.openai.schema import NamedToolChoice
from trillm.web.openai.translation import FitMaxTokens

TOK = MockTokenizer(1000)
MODEL = RequestLimits(max_model_len=100, block_size=16, num_usable_blocks=1000, vocab_size=TOK.vocab_size,
                      max_waiting=10)
USER = [{"role": "user", "content": "hello"}]


def body(**fields: Any) -> MessagesRequest:
    return parse_body(MessagesRequest, json.dumps({"model": "m", "max_tokens": 10, "messages": USER, **fields}))


def chat(**fields: Any) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in chat_body(body(**fields)).messages]


def test_system_and_content_as_strings_or_blocks() -> None:
    assert chat(system="be brief") == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    blocks = chat(system=[{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                          {"type": "text", "text": "b"}],
                  messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y",
                                                                                       "cache_control": {"type": "ephemeral"}}]}])
    assert blocks == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "xy"}]


def test_tool_use_and_tool_result_history() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "let me look", "signature": "sig"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}],
             "is_error": True},
            {"type": "text", "text": "and tomorrow?"}]},
    ]
    got = chat(messages=messages)
    assert got[1] == {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert got[2:] == [{"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
                       {"role": "tool", "content": "Error: a\nb", "tool_call_id": "toolu_2"},
                       {"role": "user", "content": "and tomorrow?"}]
    # The templated prompt sees the tool call's arguments as an object, as templates want.
    req = parse_generation(chat_body(body(messages=messages)), "m", TOK, MODEL, Limits())
    assert req.prompt_token_ids


@pytest.mark.parametrize("block, message", [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "xx"}}, "text only"),
    ({"type": "document", "source": {"type": "text", "data": "xx"}}, "text only"),
    ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}, "text only"),
    ({"type": "search_result", "source": "x", "title": "t", "content": []}, "'search_result' are not supported"),
    ({"type": "tool_use", "id": "t", "name": "f", "input": {}}, "belong in assistant messages"),
])
def test_refused_blocks_say_why(block: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        chat_body(body(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, block]}]))
    assert "messages.0.content.1" in str(info.value)


def test_prefill_server_tools_and_forced_tools_are_refused_clearly() -> None:
    with pytest.raises(InvalidRequest, match="prefill"):
        chat_body(body(messages=[*USER, {"role": "assistant", "content": "The answer is"}]))
    with pytest.raises(InvalidRequest, match="server tool"):
        chat_body(body(tools=[{"type": "web_search_20250305", "name": "web_search"}]))
    with pytest.raises(InvalidRequest, match="input_schema"):
        chat_body(body(tools=[{"name": "f"}]))
    # A forced tool is enforced by the grammar, so it must be one of the tools.
    with pytest.raises(InvalidRequest, match="tool"):
        parse_generation(chat_body(body(tools=[{"name": "f", "input_schema": {"type": "object"}}],
                                        tool_choice={"type": "tool", "name": "g"})), "m", TOK, MODEL, Limits())


def test_tools_tool_choice_and_output_format() -> None:
    tools = [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"},
              "cache_control": {"type": "ephemeral"}}]
    internal = chat_body(body(tools=tools))
    assert internal.tools is not None and internal.tools[0].function.name == "get_weather"
    assert internal.tools[0].function.parameters == {"type": "object"} and internal.tool_choice is None
    assert chat_body(body(tools=tools, tool_choice={"type": "none"})).tool_choice == "none"
    assert chat_body(body(tools=tools, tool_choice={"type": "auto"})).tool_choice == "auto"
    assert chat_body(body(tools=tools, tool_choice={"type": "any"})).tool_choice == "required"
    named = chat_body(body(tools=tools, tool_choice={"type": "tool", "name": "get_weather",
                                                     "disable_parallel_tool_use": True}))
    assert isinstance(named.tool_choice, NamedToolChoice) and named.tool_choice.function.name == "get_weather"
    assert named.parallel_tool_calls is False
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = chat_body(body(output_config={"format": {"type": "json_schema", "schema": schema}})).response_format
    assert fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None
    assert fmt.json_schema.schema_ == schema and fmt.json_schema.strict is True


def test_sampling_defaults_and_values() -> None:
    internal = chat_body(body())
    assert (internal.temperature, internal.top_p, internal.top_k) == (1.0, 1.0, 0)
    internal = chat_body(body(temperature=0, top_p=0.5, top_k=3, stop_sequences=["END", "\n\n"], stream=True,
                              metadata={"user_id": "u"}, output_config={"effort": "low"}))
    assert (internal.temperature, internal.top_p, internal.top_k, internal.stream) == (0.0, 0.5, 3, True)
    assert internal.stop_strings == ("END", "\n\n")
    assert chat_body(body(thinking={"type": "disabled"})).chat_template_kwargs == {"enable_thinking": False}
    assert chat_body(body(thinking={"type": "enabled", "budget_tokens": 2000})).chat_template_kwargs == {
        "enable_thinking": True}
    assert chat_body(body(thinking={"type": "adaptive"})).chat_template_kwargs == {"enable_thinking": True}
    assert chat_body(body()).chat_template_kwargs == {"enable_thinking": False}  # off unless asked, as Anthropic's


@pytest.mark.parametrize("fields", [
    {"max_tokens": None}, {"max_tokens": "5"}, {"max_tokens": 0}, {"temperature": 1.5}, {"top_p": 0},
    {"stop_sequences": [""]}, {"messages": []}, {"messages": [{"role": "tool", "content": "x"}]},
    {"tool_choice": {"type": "tool"}}, {"thinking": {"type": "enabled"}}, {"stream": 1},
])
def test_invalid_bodies_are_400(fields: dict[str, Any]) -> None:
    raw = {"model": "m", "max_tokens": 10, "messages": USER, **fields}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(InvalidRequest):
        parse_body(MessagesRequest, json.dumps(raw))


def test_count_tokens_body_needs_no_max_tokens_and_makes_the_same_prompt() -> None:
    count = parse_body(CountTokensRequest, json.dumps({"model": "m", "messages": USER, "system": "s"}))
    a = parse_generation(chat_body(count), "m", TOK, MODEL, Limits())
    b = parse_generation(chat_body(body(system="s")), "m", TOK, MODEL, Limits())
    assert a.prompt_token_ids == b.prompt_token_ids


def test_max_tokens_fits_the_context() -> None:
    internal = chat_body(body())
    fit = FitMaxTokens(32000)
    req = fit(parse_generation(internal, "m", TOK, MODEL, Limits()))
    assert req.params[0].max_tokens == 100 - len(req.prompt_token_ids)
    assert fit.context_limited(req, None)
    small = FitMaxTokens(5)
    req = small(parse_generation(internal, "m", TOK, MODEL, Limits()))
    assert req.params[0].max_tokens == 5 and not small.context_limited(req, None)
    capped = FitMaxTokens(32000)
    req = capped(parse_generation(internal, "m", TOK, MODEL, Limits(max_tokens_limit=7)))
    assert req.params[0].max_tokens == 7 and not capped.context_limited(req, 7)


# ---- output ----

EVENTS: list[OutputEvent] = [
    ReasoningDelta("hmm, "), ReasoningDelta("weather"), TextDelta("Let me "), TextDelta(""), TextDelta("check."),
    ToolCallStart(0, "call_a", "get_weather"), ToolCallArgumentsDelta(0, '{"city": '),
    ToolCallArgumentsDelta(0, '"Paris"}'), ToolCallEnd(0, '{"city": "Paris"}'),
    ToolCallStart(1, "call_b", "get_time"), ToolCallEnd(1, "{}"),
]
STREAM = TypeAdapter(RawMessageStreamEvent)


def run(events: list[OutputEvent], finish: OutputEnd, usage: Usage, **kw: Any) -> tuple[MessageTranslator,
                                                                                   list[dict[str, Any]]]:
    t = MessageTranslator(model="m", prompt_tokens=usage.prompt_tokens, **kw)
    out = t.start()
    for ev in events:  # one event at a time, as a token-by-token stream would bring them
        out += t.feed([ev], Usage(usage.prompt_tokens, 1, usage.cached_tokens))
    out += t.feed([finish], usage)
    return t, out


def test_stream_events_in_anthropic_order_add_up_to_the_message() -> None:
    t, events = run(EVENTS, OutputEnd("tool_calls", 2), Usage(40, 12, 32))
    kinds = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None),
    ]
    message = t.message()
    assert message["stop_reason"] == "tool_use" and message["id"].startswith("msg_")
    assert message["content"] == [
        {"type": "thinking", "thinking": "hmm, weather", "signature": ""},
        {"type": "text", "text": "Let me check.", "citations": None},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_b", "name": "get_time", "input": {}},
    ]
    assert message["usage"] == {"input_tokens": 8, "output_tokens": 12, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 32}
    # The official SDK's own accumulator, fed our events, arrives at the same message.
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for ev in events:
        snapshot = accumulate_event(event=STREAM.validate_python(ev), current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    assert snapshot.to_dict(exclude_none=True) == Message.model_validate(message).to_dict(exclude_none=True)


@pytest.mark.parametrize("finish, kw, stop_reason, stop_sequence", [
    (OutputEnd("stop", 2), {}, "end_turn", None),
    (OutputEnd("stop", "END"), {"stop_sequences": ["END"]}, "stop_sequence", "END"),
    (OutputEnd("stop", "</tool_call>"), {"stop_sequences": ["END"]}, "end_turn", None),  # not the client's
    (OutputEnd("length"), {}, "max_tokens", None),
    (OutputEnd("length"), {"context_limited": True}, "model_context_window_exceeded", None),
    (OutputEnd("tool_calls", 2), {}, "tool_use", None),
    (OutputEnd("grammar", error="no token allowed"), {}, "end_turn", None),
])
def test_stop_reasons(finish: OutputEnd, kw: dict[str, Any], stop_reason: str, stop_sequence: str | None) -> None:
    t, events = run([TextDelta("hi")], finish, Usage(5, 3, 0), **kw)
    assert events[-2]["delta"] == {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    assert (t.message()["stop_reason"], t.message()["stop_sequence"]) == (stop_reason, stop_sequence)


def test_empty_answer_has_no_blocks() -> None:
    t, events = run([], OutputEnd("stop", 2), Usage(5, 1, 0))
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    assert t.message()["content"] == []


@pytest.mark.parametrize("exc, status, kind", [
    (Overloaded("full"), 529, "overloaded_error"), (InvalidRequest("bad"), 400, "invalid_request_error"),
    (APIError(401, "key"), 401, "authentication_error"), (APIError(404, "no"), 404, "not_found_error"),
    (APIError(413, "big"), 413, "request_too_large"), (RuntimeError("x"), 500, "api_error"),
])
def test_errors_in_anthropic_shape(exc: Exception, status: int, kind: str) -> None:
    got_status, body = anthropic_error(to_api_error(exc))
    assert got_status == status and body["type"] == "error" and body["error"]["type"] == kind
    assert isinstance(body["error"]["message"], str)
