"""Hostile bodies on /v1/messages and /v1/responses, by hand and by hypothesis: a 4xx in the API's own error
shape, never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from trillm.web.anthropic.schema import MessagesRequest
from trillm.web.responses.schema import ResponsesRequest

from conftest import MockFactory, running_app

MESSAGE = {"model": "mock-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]}
RESPONSE = {"model": "mock-model", "max_output_tokens": 3, "input": "hello"}

RAW: list[tuple[str, bytes]] = [
    ("/v1/messages", b"{not json"),
    ("/v1/messages", b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/messages", b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}], '
                     b'"temperature": NaN}'),
    ("/v1/messages", b'{"model": "m", "max_tokens": 3, "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("/v1/messages/count_tokens", b'{"model": "mock-model"}'),
    ("/v1/responses", b'{"input": "\xff\xfe"}'),
    ("/v1/responses", b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("/v1/responses", b"[1]"),
]

BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/messages", {**MESSAGE, "max_tokens": 10**12}),
    ("/v1/messages", {**MESSAGE, "stop_sequences": ["a"] * 100}),  # past the server's cap
    ("/v1/messages", {**MESSAGE, "stop_sequences": ["x" * 10_000]}),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": [{"type": 5}]}]}),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]}),  # unhashable
    ("/v1/responses", {**RESPONSE, "input": [{"type": {"a": 1}, "role": "user", "content": "x"}]}),
    ("/v1/responses", {**RESPONSE, "input": [{"type": "message", "role": "user", "content": [{"type": ["x"]}]}]}),
    ("/v1/responses", {**RESPONSE, "tool_choice": {"type": "zzz"}}),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}),
    ("/v1/messages", {**MESSAGE, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                      "tool_choice": {"type": "tool", "name": "g"}}),
    ("/v1/messages", {**MESSAGE, "tool_choice": {"type": "any"}}),  # no tools
    ("/v1/messages", {**MESSAGE, "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}),
    ("/v1/responses", {**RESPONSE, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}),
    ("/v1/messages", {**MESSAGE, "system": [{"type": "image"}]}),
    ("/v1/responses", {**RESPONSE, "store": True}),
    ("/v1/responses", {**RESPONSE, "input": [{"type": "message", "role": "user", "content": [{"type": 1}]}]}),
    ("/v1/responses", {**RESPONSE, "input": [{"type": None}]}),
    ("/v1/responses", {**RESPONSE, "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}),
    ("/v1/responses", {**RESPONSE, "max_output_tokens": 10**12}),
]


def _check_shape(path: str, status: int, body: Any) -> None:
    assert 400 <= status < 500, (path, status, body)
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["type"].endswith("_error"), body
    else:
        assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert "Traceback" not in json.dumps(body)


@pytest.mark.parametrize("path, data", RAW + [(p, json.dumps(b).encode()) for p, b in BODIES])
async def test_hostile_bodies_are_4xx_in_the_api_shape(path: str, data: bytes) -> None:
    async with running_app(MockFactory()) as client:
        r = await client.post(path, data=data, headers={"Content-Type": "application/json"})
        _check_shape(path, r.status_code, json.loads(await r.get_data()))


async def test_too_large_and_not_json_bodies() -> None:
    async with running_app(MockFactory(), max_request_bytes=2048) as client:
        big = json.dumps({**MESSAGE, "system": "x" * 4096})
        r = await client.post("/v1/messages", data=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and (await r.get_json())["error"]["type"] == "request_too_large"
        r = await client.post("/v1/messages", data=json.dumps(MESSAGE), headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and (await r.get_json())["error"]["type"] == "invalid_request_error"
        r = await client.post("/v1/responses", data=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "error" in await r.get_json()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
BLOCK_TYPES = st.sampled_from(["text", "image", "document", "tool_use", "tool_result", "thinking",
                               "redacted_thinking", "search_result", "input_text", "output_text", "function_call",
                               "function_call_output", "reasoning", "item_reference", "message", "web_search"])
blocks = st.builds(lambda kind, extra: {"type": kind, **extra}, BLOCK_TYPES,
                   st.dictionaries(st.sampled_from(["text", "id", "name", "input", "content", "tool_use_id",
                                                    "call_id", "arguments", "output", "role", "thinking"]),
                                   json_values, max_size=4))


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_fuzzed_bodies_never_get_a_5xx(data: st.DataObject) -> None:
    messages = data.draw(st.booleans())
    model = MessagesRequest if messages else ResponsesRequest
    body: dict[str, Any] = dict(MESSAGE if messages else RESPONSE)
    for name in data.draw(st.lists(st.sampled_from(sorted(model.model_fields)), max_size=3, unique=True)):
        body[name] = data.draw(json_values)
    content = data.draw(st.lists(blocks, min_size=1, max_size=3))
    if messages:
        body["messages"] = [{"role": data.draw(st.sampled_from(["user", "assistant"])), "content": content}]
    else:
        body["input"] = content
    for key in ("max_tokens", "max_output_tokens"):  # a valid but long request would only make the test slow
        if key in body and (not isinstance(body[key], int) or isinstance(body[key], bool) or body[key] > 16):
            body[key] = 2
    path = "/v1/messages" if messages else "/v1/responses"
    async with running_app(MockFactory()) as client:
        r = await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
        if r.status_code >= 400:
            _check_shape(path, r.status_code, json.loads(await r.get_data()))
        else:
            assert r.status_code == 200
