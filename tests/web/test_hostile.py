"""Hostile request bodies, by hand and by hypothesis: each is a 4xx in OpenAI's shape, the engine never
restarts, and a stream running meanwhile finishes normally."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

from trillm.web.openai_schema import ChatCompletionRequest, CompletionRequest

from conftest import MockFactory, parse_sse, running_app, running_server

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
COMPLETION = {"prompt": "hello", "max_tokens": 4}
BIG = "9" * 4300

# (endpoint, raw body) pairs; every one must be refused with a 4xx.
RAW: list[tuple[str, bytes]] = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),  # lone surrogate
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),  # invalid UTF-8
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1e999}'),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),  # deep nesting
    ("/v1/completions", b"[1, 2, 3]"),
    ("/v1/completions", b'"just a string"'),
    ("/tokenize", b'{"prompt": 5}'),
    ("/detokenize", b'{"tokens": [1, -2]}'),
    ("/detokenize", b'{"tokens": [99999999999]}'),
]

# Bodies that once crashed the engine thread or slowed every step: now refused at the boundary.
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [[1]]}),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": ["x"], "min_tokens": 2}),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [1.5], "min_tokens": 2}),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [10**9]}),  # past the vocabulary
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": list(range(3, 500))}),  # past the cap
    ("/v1/chat/completions", {**CHAT, "stop": ["a"] * 100}),
    ("/v1/chat/completions", {**CHAT, "stop": ["x" * 10_000]}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(i): 1 for i in range(5000)}}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1000}}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"-1": 1}}),
    ("/v1/chat/completions", {**CHAT, "n": 1000}),
    ("/v1/chat/completions", {**CHAT, "priority": -100}),  # may not jump the queue
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 500, "logprobs": True}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}),
    ("/v1/completions", {**COMPLETION, "echo": "yes"}),
    ("/v1/completions", {**COMPLETION, "echo": True, "n": 2, "temperature": 1.0}),
    ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": 21}),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 21}),
    ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 1000}),
    ("/v1/chat/completions", {**CHAT, "echo": True}),
    ("/v1/completions", {**COMPLETION, "best_of": 3}),
    ("/v1/completions", {**COMPLETION, "prompt": [1, "a"]}),
    ("/v1/completions", {**COMPLETION, "prompt": [True]}),
    ("/v1/completions", {**COMPLETION, "prompt": [-1]}),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}),
    ("/v1/completions", {**COMPLETION, "max_tokens": 10**12}),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}),
    ("/v1/completions", {**COMPLETION, "stream": "yes"}),
]


def _seed_body() -> str:
    # A 4,300-digit seed with n=2 used to raise in the sampler's key derivation (json.dumps refuses the int).
    return json.dumps({**CHAT, "n": 2}).replace('"n": 2', f'"n": 2, "seed": {BIG}')


async def _expect_4xx(client: httpx.AsyncClient, path: str, data: bytes | str,
                      content_type: str = "application/json") -> None:
    r = await client.post(path, content=data, headers={"Content-Type": content_type})
    assert 400 <= r.status_code < 500, (path, data[:200], r.status_code)
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert "Traceback" not in body["error"]["message"]


async def test_hostile_bodies_fail_alone_while_another_stream_runs() -> None:
    factory = MockFactory(step_delay=0.002)
    async with running_server(factory) as serving, httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
        result: dict[str, Any] = {}

        async def long_stream() -> None:
            r = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 300, "stream": True,
                                                           "ignore_eos": True})
            result["events"] = parse_sse(r.content)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            await trio.sleep(0.05)
            for path, data in RAW:
                await _expect_4xx(client, path, data)
            for path, body in BODIES:
                await _expect_4xx(client, path, json.dumps(body))
            await _expect_4xx(client, "/v1/chat/completions", _seed_body())
            # A browser's simple form POST (no preflight) is not read as JSON: no blind CSRF.
            await _expect_4xx(client, "/v1/chat/completions", json.dumps(CHAT), "text/plain")
        events = result["events"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(bool(e["choices"] and e["choices"][0]["text"]) for e in events[:-1]) == 300
        assert len(factory.engines) == 1  # never restarted


async def test_websocket_frames_fail_alone_and_the_socket_stays_open() -> None:
    async with running_app(MockFactory()) as client:
        async with client.websocket("/v1/ws") as ws:
            frames = ['{"type": "generate", "id": 1, "prompt": "\\ud800"}', "[" * 5000 + "]" * 5000,
                      json.dumps({"type": "generate", "id": 2, **CHAT, "stop_token_ids": [[1]]}),
                      json.dumps({"type": "generate", "id": 3, **COMPLETION, "n": 17}),
                      json.dumps({"type": "generate", "id": 4, "prompt": "x", "logit_bias": {"a": 1}})]
            for frame in frames:
                await ws.send(frame)
                msg = json.loads(await ws.receive())
                assert msg["type"] == "error" and 400 <= _status(msg) < 500, msg
            await ws.send(json.dumps({"type": "generate", "id": 9, **COMPLETION}))
            while (msg := json.loads(await ws.receive()))["type"] == "delta":
                pass
            assert msg["type"] == "done" and msg["usage"]["completion_tokens"] == 4


def _status(msg: dict[str, Any]) -> int:
    code = msg["error"]["code"]
    return 429 if code == "too_many_requests" else 400  # every error here is the request's fault


# ---- fuzzing: any JSON in any field is a 4xx or a 200, never a 5xx ----

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _fields(model: type[Any]) -> list[str]:
    return sorted(model.model_fields)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_fuzzed_bodies_never_get_a_5xx(data: st.DataObject) -> None:
    chat = data.draw(st.booleans())
    model = ChatCompletionRequest if chat else CompletionRequest
    body: dict[str, Any] = dict(CHAT if chat else COMPLETION)
    for name in data.draw(st.lists(st.sampled_from(_fields(model)), min_size=1, max_size=4, unique=True)):
        body[name] = data.draw(json_values)
    if not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool) or body["max_tokens"] > 64:
        body["max_tokens"] = 2  # (a valid but long request would only make the test slow)
    async with running_app(MockFactory()) as client:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        r = await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (body, await r.get_data())
