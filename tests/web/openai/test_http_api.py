"""The HTTP API through quart's test client, against the mock engine: formats, parameters, errors."""

from __future__ import annotations

import json
import threading
from functools import partial
from typing import Any

import trio

from trillm.engine.config import EngineConfig
from trillm.engine.mock import MockModelSpec, Recording
from trillm.engine.mock.tokenizer import MockTokenizer
from trillm.web.app import create_app
from trillm.web.config import ServerConfig
from trillm.web.openai.request import Limits
from trillm.web.service.engine_service import EngineService

from conftest import SPEC, TOKENIZER, MockFactory, parse_sse, reference_text, running_app, running_service

MESSAGES = [{"role": "user", "content": "Hello there"}]
CHAT_IDS = TOKENIZER.apply_chat_template(MESSAGES)


async def test_chat_completion_non_streaming() -> None:
    async with running_app(MockFactory()) as client:
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 9, "temperature": 0})
        assert r.status_code == 200
        body = await r.get_json()
    assert body["object"] == "chat.completion" and body["model"] == "mock-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": reference_text(CHAT_IDS, 9)}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(CHAT_IDS), "completion_tokens": 9,
                             "total_tokens": len(CHAT_IDS) + 9, "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_stream_format_and_usage_with_cached_tokens() -> None:
    long_messages = [{"role": "user", "content": "x " * 40}]
    ids = TOKENIZER.apply_chat_template(long_messages)
    req = {"messages": long_messages, "max_tokens": 6, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    async with running_app(MockFactory()) as client:
        await client.post("/v1/chat/completions", json={**req, "stream": False})  # warms the prefix cache
        r = await client.post("/v1/chat/completions", json=req)
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = parse_sse(await r.get_data())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == reference_text(ids, 6)
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    assert finish[0]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == len(ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] == ((len(ids) - 1) // 16) * 16  # the last one recomputed


async def test_completions_logprobs_stop_and_n() -> None:
    async with running_app(MockFactory()) as client:
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "temperature": 0,
                                                       "logprobs": 2})
        body = await r.get_json()
        prompt_ids = TOKENIZER.encode("abc", add_special_tokens=True)
        text = reference_text(prompt_ids, 5)
        choice = body["choices"][0]
        assert body["object"] == "text_completion" and choice["text"] == text
        lp = choice["logprobs"]
        assert "".join(lp["tokens"]) == text and lp["token_logprobs"] == [-1.0] * 5
        assert [len(t) for t in lp["top_logprobs"]] == [2] * 5
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]

        stop = lp["tokens"][3]
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "temperature": 0,
                                                       "stop": stop})
        choice = (await r.get_json())["choices"][0]
        assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"

        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 7, "n": 3, "seed": 5})
        body = await r.get_json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == 21
        r2 = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 7, "n": 3, "seed": 5})
        assert [c["text"] for c in (await r2.get_json())["choices"]] == [c["text"] for c in body["choices"]]


async def test_chat_logprobs_and_tools_reach_the_template() -> None:
    async with running_app(MockFactory()) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
        body = await r.get_json()
    ids = TOKENIZER.apply_chat_template(MESSAGES, tools=[{}])
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == reference_text(ids, 3)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode()) for c in content)


async def error_of(r: Any) -> dict[str, Any]:
    body = await r.get_json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


async def test_errors_use_openai_shape_and_status() -> None:
    small = MockModelSpec(name="mock-model", vocab_size=SPEC.vocab_size, max_model_len=64)
    async with running_app(MockFactory(spec=small), limits=Limits(max_tokens_limit=100),
                           max_request_bytes=2048) as client:
        r = await client.post("/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        await error_of(r)
        r = await client.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
        assert r.status_code == 404 and (await error_of(r))["code"] == "model_not_found"
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 101})
        assert r.status_code == 400 and "at most 100" in (await error_of(r))["message"]
        r = await client.post("/v1/completions", json={"prompt": "y " * 80})
        assert r.status_code == 400 and "context" in (await error_of(r))["message"]  # the engine's limits
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": -1})
        assert r.status_code == 400 and "temperature" in (await error_of(r))["message"]
        r = await client.post("/v1/chat/completions", json={"messages": "hi"})
        assert r.status_code == 400
        r = await client.post("/v1/completions", json={"prompt": "z" * 5000})
        assert r.status_code == 413
        await error_of(r)
        r = await client.get("/v1/nowhere")
        assert r.status_code == 404
        await error_of(r)


async def test_overloaded_is_503_with_retry_after() -> None:
    cfg = EngineConfig(num_kv_blocks=256, max_num_seqs=1, max_num_batched_tokens=64, max_waiting=0)
    async with running_app(MockFactory(config=cfg, step_delay=0.01)) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/completions", json={"prompt": "a", "max_tokens": 30}))
            await trio.sleep(0.1)
            r = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 3})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert (await error_of(r))["code"] == "overloaded"


async def test_internal_errors_hide_the_traceback() -> None:
    class BrokenTokenizer(MockTokenizer):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            raise RuntimeError("secret detail")

        def apply_chat_template(self, *a: Any, **kw: Any) -> list[int]:
            raise RuntimeError("no system role")

    async with running_service(MockFactory()) as service:
        service.tokenizer = BrokenTokenizer()
        client = create_app([service]).test_client()
        r = await client.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 500
        err = await error_of(r)
        assert err["message"] == "internal server error" and "secret" not in json.dumps(err)
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 400 and "no system role" in (await error_of(r))["message"]  # the request's fault


async def test_api_key_guards_v1_but_not_health() -> None:
    async with running_app(MockFactory(), api_key="sekrit") as client:
        assert (await client.get("/v1/models")).status_code == 401
        r = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and (await error_of(r))["type"] == "authentication_error"
        r = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and (await r.get_json())["data"][0]["id"] == "mock-model"
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/tokenize", json={"prompt": "a"})).status_code == 401


async def test_health_is_503_while_loading() -> None:
    async with trio.open_nursery() as nursery:
        service = EngineService(MockFactory(load_delay=0.5))
        nursery.start_soon(service.run)
        client = create_app([service], ServerConfig()).test_client()
        r = await client.get("/health")
        assert r.status_code == 503 and (await r.get_json())["models"]["loading"]["state"] == "loading"
        assert (await client.get("/health")).status_code == 503
        r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})  # waits for the load
        assert r.status_code == 200 and (await client.get("/health")).status_code == 200
        nursery.cancel_scope.cancel()


async def test_metrics_tokenize_detokenize() -> None:
    async with running_app(MockFactory()) as client:
        await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
        await client.post("/v1/completions", json={"prompt": "q " * 3000})
        text = await (await client.get("/metrics")).get_data(as_text=True)
        assert 'trillm_requests_total{model="mock-model",outcome="length"} 1' in text
        assert 'trillm_requests_total{model="mock-model",outcome="rejected"} 1' in text
        assert 'trillm_time_to_first_token_seconds_count{model="mock-model"} 1' in text
        assert 'trillm_inter_token_latency_seconds_count{model="mock-model"} 3' in text
        assert 'trillm_generation_tokens_total{model="mock-model"} 4' in text
        for family in ("trillm_e2e_request_latency_seconds_bucket", "trillm_kv_blocks_used",
                       "trillm_num_requests_waiting", "trillm_prefix_cache_hit_rate", "trillm_prompt_tokens_total"):
            assert family in text
        r = await client.post("/tokenize", json={"prompt": "ab cd"})
        tok = await r.get_json()
        assert tok["count"] == len(tok["tokens"]) == 2 and tok["tokens"] == TOKENIZER.encode("ab cd")
        r = await client.post("/detokenize", json={"tokens": tok["tokens"]})
        assert (await r.get_json())["prompt"] == " ab cd"
        r = await client.post("/tokenize", json={"messages": MESSAGES})
        assert (await r.get_json())["tokens"] == CHAT_IDS


async def test_sse_keepalive_while_prefilling() -> None:
    cfg = EngineConfig(num_kv_blocks=4096, max_num_seqs=4, max_num_batched_tokens=4)
    async with running_app(MockFactory(config=cfg, step_delay=0.01), sse_keepalive_s=0.05) as client:
        r = await client.post("/v1/completions", json={"prompt": "p " * 60, "max_tokens": 2, "stream": True})
        data = await r.get_data()
    assert data.count(b": keepalive") >= 2
    events = parse_sse(data)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


async def test_websocket_multiplexes_cancels_and_survives_bad_input() -> None:
    async with running_app(MockFactory(step_delay=0.002)) as client:
        async with client.websocket("/v1/ws") as ws:
            await ws.send("not json")
            assert json.loads(await ws.receive())["type"] == "error"
            await ws.send(json.dumps({"type": "generate", "id": "long", "prompt": "a", "max_tokens": 400}))
            await ws.send(json.dumps({"type": "generate", "id": "b", "messages": MESSAGES, "max_tokens": 5,
                                      "temperature": 0}))
            await ws.send(json.dumps({"type": "generate", "id": "c", "prompt": "abc", "max_tokens": 4,
                                      "temperature": 0}))
            await ws.send(json.dumps({"type": "wat", "id": "d"}))
            texts: dict[str, str] = {"b": "", "c": "", "long": ""}
            finals: dict[str, dict[str, Any]] = {}
            long_deltas = 0
            while len(finals) < 3:
                msg = json.loads(await ws.receive())
                if msg["type"] == "delta":
                    texts[msg["id"]] += msg["text"]
                    long_deltas += msg["id"] == "long"
                    if msg["id"] == "long" and long_deltas == 3:
                        await ws.send(json.dumps({"type": "cancel", "id": "long"}))
                elif msg["type"] == "error":
                    assert msg["id"] == "d"
                else:
                    finals[msg["id"]] = msg
            assert finals["long"]["type"] == "cancelled"
            assert finals["b"]["type"] == "done" and finals["b"]["usage"]["completion_tokens"] == 5
            assert texts["b"] == reference_text(CHAT_IDS, 5)
            assert texts["c"] == reference_text(TOKENIZER.encode("abc", add_special_tokens=True), 4)
            assert 3 <= long_deltas < 400


async def test_websocket_requires_the_api_key() -> None:
    from quart.testing import WebsocketResponseError

    async with running_app(MockFactory(), api_key="sekrit") as client:
        statuses = []
        try:
            async with client.websocket("/v1/ws") as ws:
                await ws.send(json.dumps({"type": "generate", "id": 1, "prompt": "a", "max_tokens": 2}))
                await ws.receive()
        except* WebsocketResponseError as group:
            statuses = [e.response.status_code for e in group.exceptions]  # type: ignore[attr-defined]
        assert statuses == [401]
        async with client.websocket("/v1/ws", headers={"Authorization": "Bearer sekrit"}) as ws:
            await ws.send(json.dumps({"type": "generate", "id": 1, "prompt": "a", "max_tokens": 2}))
            assert json.loads(await ws.receive())["type"] == "delta"


async def test_lazy_model_loads_on_the_first_request() -> None:
    factory = MockFactory()
    async with running_app(factory, service_config={"lazy_load": True}) as client:
        assert (await client.get("/health")).status_code == 200 and factory.engines == []
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and len(factory.engines) == 1


async def test_two_models_each_on_its_own_thread_selected_by_name() -> None:
    abc = TOKENIZER.encode("abc", add_special_tokens=True)
    fa, fb = MockFactory(), MockFactory(recording=Recording([(abc, [10, 11, 2])]))  # b stops on EOS (2) after 2
    async with trio.open_nursery() as nursery:
        a = await nursery.start(EngineService(fa, name="model-a").run)
        b = await nursery.start(EngineService(fb, name="model-b").run)
        client = create_app([a, b]).test_client()
        ids = [m["id"] for m in (await (await client.get("/v1/models")).get_json())["data"]]
        assert ids == ["model-a", "model-b"]
        body = {"prompt": "abc", "max_tokens": 6, "temperature": 0}
        ra = await (await client.post("/v1/completions", json={**body, "model": "model-a"})).get_json()
        rb = await (await client.post("/v1/completions", json={**body, "model": "model-b"})).get_json()
        rd = await (await client.post("/v1/completions", json=body)).get_json()  # no model: the first one
        assert (ra["model"], rb["model"], rd["model"]) == ("model-a", "model-b", "model-a")
        assert ra["usage"]["completion_tokens"] == 6 and rb["choices"][0]["finish_reason"] == "stop"
        assert rb["choices"][0]["text"] == TOKENIZER.decode([10, 11])
        assert fa.threads[0] != fb.threads[0] and threading.get_ident() not in fa.threads + fb.threads
        nursery.cancel_scope.cancel()
