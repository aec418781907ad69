"""Hostile request bodies, by hand and by hypothesis: each is a 4xx in OpenAI's shape, the engine never
restarts, and a stream running meanwhile finishes normally."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from hypothesis import HealthCheck, given, settings, strategies as st

from trillm.web.config import ServerConfig
from trillm.web.openai.schema import ChatCompletionRequest, CompletionRequest

from conftest import SPEC, MockFactory, parse_sse, raw_http, running_app, running_server

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


# ---- every endpoint, raw HTTP and websocket frames, each while a stream runs ----

SPEC_VOCAB = SPEC.vocab_size
GET_PATHS = ["/", "/health", "/metrics", "/stats", "/v1/models", "/openapi.json"]
POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
TOKENIZE = {"prompt": "hello"}

# More bodies for the smaller endpoints (the generation ones are above).
MORE_BODIES: list[tuple[str, bytes]] = [
    ("/tokenize", b"{}"),
    ("/tokenize", b""),
    ("/tokenize", json.dumps({"messages": []}).encode()),
    ("/tokenize", json.dumps({"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"add_generation_prompt": "no"}}).encode()),
    ("/tokenize", json.dumps({"prompt": "x" * (5 << 20)}).encode()),  # past the body limit
    ("/tokenize", json.dumps({"prompt": "x", "model": "nope"}).encode()),
    ("/detokenize", b"{}"),
    ("/detokenize", json.dumps({"tokens": "abc"}).encode()),
    ("/detokenize", json.dumps({"tokens": [1.5]}).encode()),
    ("/detokenize", json.dumps({"tokens": [True]}).encode()),
    ("/detokenize", json.dumps({"tokens": [SPEC_VOCAB]}).encode()),
    ("/detokenize", json.dumps({"tokens": [[1]]}).encode()),
    ("/v1/completions", b"null"),
    ("/v1/completions", b"{}"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "chat_template_kwargs": {"messages": 5}}).encode()),
    ("/v1/chat/completions", json.dumps({**CHAT, "n": 2, "stream": True, "stream_options": []}).encode()),
    ("/v1/chat/completions", json.dumps({**CHAT, "cache_salt": ""}).encode()),
    ("/v1/chat/completions", json.dumps({**CHAT, "response_format": {"type": "json_schema"}}).encode()),
]

# Bytes on the wire that are not (valid) HTTP, or that ask too much; each must get a 4xx (and a close).
def _raw(head: bytes, body: bytes = b"", *, length: bool = False) -> bytes:
    if length:
        head += b"\r\nContent-Length: " + str(len(body)).encode()
    return head + b"\r\nConnection: close\r\n\r\n" + body


JSON_POST = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
RAW_HTTP: list[bytes] = [
    _raw(b"GARBAGE"),
    _raw(b"GET /health HTTP/1.1"),  # no Host
    _raw(b"GET /health HTTP/1.1\r\nHost: t\r\nX\x00: y"),
    _raw(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 100_000),
    _raw(JSON_POST + b"\r\nContent-Length: -5"),
    _raw(JSON_POST + b"\r\nContent-Length: 2\r\nContent-Length: 3", b"{}"),
    _raw(JSON_POST + b"\r\nTransfer-Encoding: chunked", b"ZZ\r\nxx\r\n0\r\n\r\n"),
    _raw(JSON_POST + b"\r\nContent-Length: " + str(5 << 20).encode()),  # past the limit: refused unread
    _raw(JSON_POST, b'{"prompt": 1}', length=True),
    _raw(b"GET /\xff\xfe HTTP/1.1\r\nHost: t"),
    _raw(b"GET /static/../../../../etc/passwd HTTP/1.1\r\nHost: t"),
    _raw(b"GET /static/%2e%2e/app.py HTTP/1.1\r\nHost: t"),
    _raw(b"DELETE /v1/completions HTTP/1.1\r\nHost: t"),
    _raw(b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json; charset=latin-1",
         b'{"prompt": "\xe9"}', length=True),
]

def _check_shape(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (r.request.url, r.status_code, r.text[:200])
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["type"] != "server_error" and "Traceback" not in r.text


async def test_every_endpoint_refuses_hostile_requests_while_a_stream_runs() -> None:
    factory = MockFactory(step_delay=0.002)
    async with running_server(factory) as serving, httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
        result: dict[str, Any] = {}

        async def long_stream() -> None:
            r = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 600, "stream": True,
                                                           "ignore_eos": True})
            result["events"] = parse_sse(r.content)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            await trio.sleep(0.05)
            for path in GET_PATHS:  # wrong method, junk query strings
                _check_shape(await client.post(path, json={}))
                r = await client.get(path + "?model=%00%ff&" + "x=" * 2000)
                assert r.status_code < 500, (path, r.status_code)
            for path in POST_PATHS:
                _check_shape(await client.get(path))
                _check_shape(await client.post(path, content=b"{}", headers={"Content-Type": "multipart/form-data"}))
                _check_shape(await client.post(path, content=b"\x00" * 100, headers={"Content-Type": "application/json"}))
            for path, data in MORE_BODIES:
                _check_shape(await client.post(path, content=data, headers={"Content-Type": "application/json"}))
            _check_shape(await client.get("/static/../app.py"))
            _check_shape(await client.get("/nowhere"))
            for raw in RAW_HTTP:
                with trio.fail_after(10):
                    data = await raw_http(serving.url, raw)
                status = int(data[9:12])
                assert data.startswith(b"HTTP/1.1 4") and 400 <= status < 500, (raw[:80], data[:200])
                head, _, payload = data.partition(b"\r\n\r\n")
                if b"application/json" in head.lower():
                    assert set(json.loads(payload)) == {"error"}
            assert (await client.get("/health")).status_code == 200
        events = result["events"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert len(factory.engines) == 1 and serving.services[0].num_restarts == 0


WS_FRAMES: list[str | bytes] = [
    "", "null", "[]", "5", '"x"', "{", "[" * 5000 + "]" * 5000, b"\xff\xfe\x00", b'{"type": "generate"}',
    json.dumps({"type": "generate"}), json.dumps({"id": 1}), json.dumps({"type": "nope", "id": 1}),
    json.dumps({"type": "generate", "id": True, **COMPLETION}), json.dumps({"type": "generate", "id": 1.5}),
    json.dumps({"type": "generate", "id": [1]}), json.dumps({"type": "cancel", "id": "never-started"}),
    '{"type": "generate", "id": 1, "prompt": "\\ud800"}', '{"type": "generate", "id": 1, "prompt": "x", '
    '"temperature": NaN}', json.dumps({"type": "generate", "id": 2, **CHAT, "stop_token_ids": [[1]]}),
    json.dumps({"type": "generate", "id": 3, **COMPLETION, "n": 17}),
    json.dumps({"type": "generate", "id": 4, "prompt": "x", "logit_bias": {"a": 1}}),
    json.dumps({"type": "generate", "id": 5, "endpoint": "chat", "prompt": "x"}),
    json.dumps({"type": "generate", "id": 6, "messages": "x"}),
    json.dumps({"type": "generate", "id": 7, **COMPLETION, "model": "nope"}),
    json.dumps({"type": "generate", "id": 8, **COMPLETION, "max_tokens": 10**12}),
    json.dumps({"type": "generate", "id": 9, "prompt": [SPEC_VOCAB + 1]}),
]


async def test_websocket_frames_fail_alone_and_the_socket_stays_open() -> None:
    factory = MockFactory(step_delay=0.002)
    async with running_server(factory) as serving:
        ws_url = serving.url.replace("http", "ws", 1) + "/v1/ws"
        async with trio_websocket.open_websocket_url(ws_url) as ws:
            await ws.send_message(json.dumps({"type": "generate", "id": "long", "prompt": "a b", "max_tokens": 400,
                                              "ignore_eos": True}))
            deltas = 0
            errors = 0
            for frame in WS_FRAMES:
                await ws.send_message(frame)
                while True:  # the long generation's deltas interleave with the answers
                    msg = json.loads(await ws.get_message())
                    if msg["type"] == "delta" and msg["id"] == "long":
                        deltas += 1
                        continue
                    break
                assert msg["type"] == "error" and msg["error"]["type"] != "server_error", (frame, msg)
                errors += 1
            for _ in range(300):  # a flood of bad frames is answered one by one, never by a close
                await ws.send_message("{")
            answered = 0
            while answered < 300:
                msg = json.loads(await ws.get_message())
                if msg["type"] == "error":
                    answered += 1
                elif msg["type"] == "delta":
                    deltas += 1
            await ws.send_message(json.dumps({"type": "generate", "id": "short", **COMPLETION}))
            final: dict[str, str] = {}
            while len(final) < 2:
                msg = json.loads(await ws.get_message())
                if msg["type"] == "delta":
                    deltas += msg["id"] == "long"
                else:
                    final[msg["id"]] = msg["type"]
            assert final == {"long": "done", "short": "done"} and deltas > 0
        # A message past the size cap closes that socket (1009), and only that one.
        async with trio_websocket.open_websocket_url(ws_url) as other:
            async with trio_websocket.open_websocket_url(ws_url) as big:
                await big.send_message("x" * (ServerConfig().max_ws_message_bytes + 1))
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await big.get_message()
                assert closed.value.reason.code == 1009
            await other.send_message(json.dumps({"type": "generate", "id": 1, **COMPLETION}))
            while (msg := json.loads(await other.get_message()))["type"] == "delta":
                pass
            assert msg["type"] == "done"
        async with trio_websocket.open_websocket_url(serving.url.replace("http", "ws", 1)
                                                     + "/internal/kv-events?model=nope") as kv:
            assert json.loads(await kv.get_message())["type"] == "error"
        # Frames sent to it are dropped, and its close is still answered (a full queue of unread frames hid it).
        async with trio_websocket.open_websocket_url(serving.url.replace("http", "ws", 1) + "/internal/kv-events",
                                                     disconnect_timeout=3) as kv:
            assert json.loads(await kv.get_message())["type"] == "hello"
            for _ in range(50):
                await kv.send_message("junk")
        assert len(factory.engines) == 1 and serving.services[0].num_restarts == 0


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
