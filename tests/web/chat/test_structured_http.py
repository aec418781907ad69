"""Structured output, reasoning and tool calls over HTTP with scripted mock engines (byte tokenizer)."""

from __future__ import annotations

import json
from typing import Any

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import jsonschema

from trillm.web.chat.tool_parsers import render_generic_history

from conftest import MockFactory, parse_sse, running_server, scripted

MESSAGES = [{"role": "user", "content": "Where is Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@asynccontextmanager
async def running_app(factory: Any, **server: Any) -> AsyncIterator[httpx.AsyncClient]:
    # a live server: parsing a constrained request runs on a worker thread, which quart's test client stalls
    async with running_server(factory, **server) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            yield client


async def post(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, Any]:
    r = await client.post("/v1/chat/completions", json=body)
    return r.status_code, (parse_sse(r.content) if body.get("stream") else r.json())


async def test_reasoning_split_and_schema_applies_after_thinking() -> None:
    answer = '<think>It is in France.</think>\n\n{"city": "Paris"}'
    body = {"messages": MESSAGES, "max_tokens": 100, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY, "strict": True}}}
    async with running_app(scripted(MESSAGES, answer), reasoning_parser="think") as client:
        status, resp = await post(client, body)
        assert status == 200, resp
        message = resp["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] == "It is in France."
        assert json.loads(message["content"]) == {"city": "Paris"} and resp["choices"][0]["finish_reason"] == "stop"
        status, events = await post(client, {**body, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "It is in France."
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        assert not any("<" in (d.get("content") or "") for d in deltas)  # no marker leaked into the answer


async def test_a_scripted_tool_call_and_the_grammar_forcing_one() -> None:
    tools = [{"type": "function", "function": {"name": "where", "parameters": CITY}}]
    answer = 'Sure.\n<tool_call>\n{"name": "where", "arguments": {"city": "Paris"}}\n</tool_call>'
    # the byte tokenizer's template ignores tools: the server renders them in the generic format
    async with running_app(scripted(render_generic_history(MESSAGES, tools), answer)) as client:
        status, resp = await post(client, {"messages": MESSAGES, "tools": tools, "max_tokens": 200})
        assert status == 200, resp
        choice = resp["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure.\n"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "where", "arguments": '{"city": "Paris"}'}
        # forced: the recording's "Sure." is not a call, so the grammar overrides it with one that validates
        status, resp = await post(client, {"messages": MESSAGES, "tools": tools, "tool_choice": "required",
                                           "parallel_tool_calls": False, "max_tokens": 400})
        assert status == 200, resp
        (call,) = resp["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "where"
        jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


async def test_invalid_constraints_are_400_before_anything_is_queued() -> None:
    factory = MockFactory()
    async with running_app(factory) as client:
        bad = [
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            {"structured_outputs": {"regex": "a(b"}},
            {"guided_grammar": "start: @@@"},
            {"guided_json": "{not json"},
            {"guided_regex": "a+", "guided_choice": ["a"]},
            {"tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": {"type": "function", "function": {"name": "g"}}},
            {"tool_choice": "required"},
            {"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]},
        ]
        for extra in bad:
            status, resp = await post(client, {"messages": MESSAGES, "max_tokens": 4, **extra})
            assert status == 400, (extra, resp)
            assert resp["error"]["message"]
        assert factory.engine.statistics().num_steps == 0


async def test_completions_take_the_vllm_extensions() -> None:
    factory = scripted([], "")  # the byte tokenizer spells anything; the mock picks among allowed bytes
    async with running_app(factory) as client:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30,
                                                        "guided_choice": ["alpha", "beta"]})
        body = r.json()
        assert r.status_code == 200, body
        assert body["choices"][0]["text"] in ("alpha", "beta") and body["choices"][0]["finish_reason"] == "stop"
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30,
                                                        "structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}})
        text = r.json()["choices"][0]["text"]
        assert len(text) == 7 and text[4] == "-" and text.replace("-", "").isdigit()
