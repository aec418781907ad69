"""Every surface renders the same output events: one scripted generation (reasoning, text, two tool calls) through
OpenAI chat completions, Anthropic Messages, OpenAI Responses and /v1/ws, streamed and not, gives the same
reasoning, answer text, calls (names and arguments) and an equivalent finish reason on each."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio_websocket

from trillm.web.chat.tool_parsers import render_generic_history

from conftest import parse_sse, running_server, scripted

MESSAGES = [{"role": "user", "content": "Weather in Paris and Rome?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
ANSWER = ('<think>Two cities: two calls.</think>Checking.\n'
          '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>')
EXPECTED = {"reasoning": "Two cities: two calls.", "text": "Checking.\n\n",
            "calls": [("weather", {"city": "Paris"}), ("weather", {"city": "Rome"})], "finish": "tool_calls"}
# Each API's word for "the output ended by calling tools".
FINISH = {"tool_calls": "tool_calls", "tool_use": "tool_calls", "completed": "tool_calls"}


def named_events(data: bytes) -> list[Any]:
    return [json.loads(line[len("data: "):]) for line in data.decode().splitlines() if line.startswith("data: ")]


def from_chat(body: dict[str, Any]) -> dict[str, Any]:
    (choice,) = body["choices"]
    m = choice["message"]
    return {"reasoning": m.get("reasoning_content"), "text": m["content"], "finish": choice["finish_reason"],
            "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]}


def from_chat_stream(chunks: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"reasoning": "", "text": "", "calls": [], "finish": None}
    args: list[str] = []
    for chunk in chunks:
        for choice in chunk.get("choices", ()) if isinstance(chunk, dict) else ():
            delta = choice["delta"]
            out["reasoning"] += delta.get("reasoning_content", "")
            out["text"] += delta.get("content") or ""
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    out["calls"].append(call["function"]["name"])
                    args.append("")
                args[call["index"]] += call["function"]["arguments"]
            out["finish"] = choice["finish_reason"] or out["finish"]
    out["calls"] = [(name, json.loads(a)) for name, a in zip(out["calls"], args)]
    return out


def from_message(m: dict[str, Any]) -> dict[str, Any]:
    blocks = m["content"]
    return {"reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            "text": "".join(b["text"] for b in blocks if b["type"] == "text"), "finish": FINISH[m["stop_reason"]],
            "calls": [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]}


def from_message_stream(events: list[Any]) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    stop = None
    for ev in events:
        if ev["type"] == "content_block_start":
            blocks.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            d, b = ev["delta"], blocks[ev["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[d["type"]]
            b[key] = b.get(key, "") + d[key]
        elif ev["type"] == "message_delta":
            stop = ev["delta"]["stop_reason"]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.get("partial_json", "{}"))
    return from_message({"content": blocks, "stop_reason": stop})


def from_response(r: dict[str, Any]) -> dict[str, Any]:
    items = r["output"]
    return {"reasoning": "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"]),
            "text": "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"]),
            "finish": FINISH[r["status"]] if any(i["type"] == "function_call" for i in items) else r["status"],
            "calls": [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]}


def from_ws(messages: list[dict[str, Any]]) -> dict[str, Any]:
    out = from_chat_stream([{"choices": [{"delta": {"reasoning_content": m.get("reasoning", ""), "content": m["text"],
                                                    "tool_calls": m.get("tool_calls", ())},
                                          "finish_reason": m["finish_reason"]}]}
                            for m in messages if m["type"] == "delta"])
    (done,) = [m for m in messages if m["type"] == "done"]
    assert done["finish_reasons"] == [out["finish"]]
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_one_generation_means_the_same_on_every_surface(stream: bool) -> None:
    factory = scripted(render_generic_history(MESSAGES, TOOLS), ANSWER)
    anthropic_tools = [{"name": "weather", "input_schema": CITY}]
    responses_tools = [{"type": "function", "name": "weather", "parameters": CITY}]
    seen: dict[str, dict[str, Any]] = {}
    async with running_server(factory, reasoning_parser="think") as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS,
                                                                  "max_tokens": 300, "stream": stream})
            seen["chat"] = from_chat_stream(parse_sse(r.content)) if stream else from_chat(r.json())
            r = await client.post("/v1/messages", json={"model": "mock-model", "messages": MESSAGES,
                                                        "tools": anthropic_tools, "max_tokens": 300, "stream": stream})
            seen["messages"] = from_message_stream(named_events(r.content)) if stream else from_message(r.json())
            r = await client.post("/v1/responses", json={"input": MESSAGES[0]["content"], "tools": responses_tools,
                                                         "max_output_tokens": 300, "stream": stream})
            response = named_events(r.content)[-1]["response"] if stream else r.json()
            seen["responses"] = from_response(response)
        async with trio_websocket.open_websocket_url(serving.url.replace("http", "ws", 1) + "/v1/ws") as ws:
            await ws.send_message(json.dumps({"type": "generate", "id": 1, "messages": MESSAGES, "tools": TOOLS,
                                              "max_tokens": 300}))
            received = [json.loads(await ws.get_message())]
            while received[-1]["type"] == "delta":
                received.append(json.loads(await ws.get_message()))
            seen["ws"] = from_ws(received)
    assert seen == {surface: EXPECTED for surface in seen}, seen
