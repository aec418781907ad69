"""A live hypercorn server on loopback with the mock engine: real sockets, the openai SDK, websockets."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import trio
import trio_websocket

from conftest import (
    TOKENIZER, MockFactory, burst_completions, parse_sse, raw_http, read_to_eof, reference_text, running_server,
)

MESSAGES = [{"role": "user", "content": "Hello there"}]
CHAT_IDS = TOKENIZER.apply_chat_template(MESSAGES)


def sdk_calls(base_url: str) -> dict[str, Any]:
    """Blocking openai SDK calls (run in a worker thread)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=10)
    out: dict[str, Any] = {}
    out["chat"] = client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=7, temperature=0)
    stream = client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    out["chat_stream"] = list(stream)
    out["completion"] = client.completions.create(model="mock-model", prompt="abc", max_tokens=5, temperature=0)
    out["completion_stream"] = list(client.completions.create(model="mock-model", prompt="abc", max_tokens=5,
                                                              temperature=0, stream=True))
    out["models"] = client.models.list()
    try:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=1, temperature=-3)
    except openai.BadRequestError as exc:
        out["bad"] = exc
    return out


async def test_openai_sdk_streaming_and_not() -> None:
    async with running_server(MockFactory(step_delay=0.001)) as serving:
        out = await trio.to_thread.run_sync(sdk_calls, serving.url)
    want_chat = reference_text(CHAT_IDS, 7)
    assert out["chat"].choices[0].message.content == want_chat
    assert out["chat"].usage.completion_tokens == 7 and out["chat"].usage.prompt_tokens == len(CHAT_IDS)
    chunks = out["chat_stream"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage.total_tokens == len(CHAT_IDS) + 7
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == ((len(CHAT_IDS) - 1) // 16) * 16
    abc = TOKENIZER.encode("abc", add_special_tokens=True)
    assert out["completion"].choices[0].text == reference_text(abc, 5)
    assert "".join(c.choices[0].text for c in out["completion_stream"] if c.choices) == reference_text(abc, 5)
    assert [m.id for m in out["models"].data] == ["mock-model"]
    assert out["bad"].status_code == 400 and "temperature" in str(out["bad"])


async def test_connection_close_reaches_eof_and_idle_keepalive_closes() -> None:
    """Regression: hypercorn 0.18 trio worker + quart-trio never closed connections (see web/asgi.py)."""
    async with running_server(MockFactory(), keep_alive_timeout_s=0.3) as serving:
        with trio.fail_after(3):
            data = await raw_http(serving.url, b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b'"error": null}}}')
        host, port = serving.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
            t0 = time.perf_counter()
            with trio.fail_after(3):
                data = await read_to_eof(stream)  # the idle keep-alive connection times out
        assert data.startswith(b"HTTP/1.1 200") and time.perf_counter() - t0 >= 0.2


async def test_256_clients_at_the_same_instant_are_all_served() -> None:
    async with running_server(MockFactory()) as serving:
        results = await burst_completions(serving.url, {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    want = reference_text(TOKENIZER.encode("hi", add_special_tokens=True), 3)
    assert len(results) == 256
    assert all(r.startswith(b"HTTP/1.1 200") and want.encode() in r for r in results)


async def blocks_used(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    line = next(ln for ln in text.splitlines() if ln.startswith("trillm_kv_blocks_used{"))
    return float(line.rsplit(" ", 1)[1])


async def test_disconnect_mid_stream_frees_kv_within_1s() -> None:
    async with running_server(MockFactory(step_delay=0.005)) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=10) as client:
            req = {"prompt": "x " * 100, "max_tokens": 1000, "stream": True, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json=req) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        break
                assert await blocks_used(client) > 0
            t0 = time.perf_counter()  # the stream is closed: the client went away
            while await blocks_used(client) > 0:
                assert time.perf_counter() - t0 < 1.0
                await trio.sleep(0.02)
        assert serving.services[0].metrics.outcomes["abort"] == 1


async def test_injected_engine_failure_ends_every_open_stream_with_an_error() -> None:
    factory = MockFactory(step_delay=0.003)
    async with running_server(factory, service_config={"restart_backoff_s": 0.05}) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=10) as client:
            started = trio.Semaphore(0)
            bodies: list[bytes] = []

            async def stream_one(i: int) -> None:
                req = {"messages": [{"role": "user", "content": str(i)}], "max_tokens": 1000, "stream": True}
                async with client.stream("POST", "/v1/chat/completions", json=req) as r:
                    chunks = []
                    async for chunk in r.aiter_bytes():
                        if not chunks:
                            started.release()
                        chunks.append(chunk)
                    bodies.append(b"".join(chunks))

            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    for i in range(6):
                        nursery.start_soon(stream_one, i)
                    for _ in range(6):
                        await started.acquire()
                    factory.fail_next_step("secret injected failure")
            for body in bodies:
                events = parse_sse(body)
                assert events[-1] == "[DONE]"
                message = events[-2]["error"]["message"]
                assert "the engine failed while serving this request" in message and "secret" not in message
            with trio.fail_after(5):
                while (await client.get("/health")).status_code != 200:
                    await trio.sleep(0.02)
            r = await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
            assert r.status_code == 200 and len(factory.engines) == 2


async def test_32_concurrent_streams_equal_sequential_over_http() -> None:
    async with running_server(MockFactory(step_delay=0.001)) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=20) as client:
            async def run(i: int) -> str:
                req = {"prompt": f"prompt number {i}", "max_tokens": 16, "temperature": 0, "stream": True}
                r = await client.post("/v1/completions", json=req)
                return "".join(e["choices"][0]["text"] for e in parse_sse(r.content)[:-1] if e["choices"])

            sequential = [await run(i) for i in range(32)]
            concurrent: dict[int, str] = {}

            async def one(i: int) -> None:
                concurrent[i] = await run(i)

            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(one, i)
    assert [concurrent[i] for i in range(32)] == sequential
    assert sequential[5] == reference_text(TOKENIZER.encode("prompt number 5", add_special_tokens=True), 16)


async def test_websocket_client_multiplexes_cancels_and_close_aborts_all() -> None:
    async with running_server(MockFactory(step_delay=0.003)) as serving:
        ws_url = serving.url.replace("http", "ws", 1) + "/v1/ws"
        async with trio_websocket.open_websocket_url(ws_url) as ws:
            for gid in ("a", "b", "c"):
                await ws.send_message(json.dumps({"type": "generate", "id": gid, "prompt": gid, "max_tokens": 500,
                                                  "ignore_eos": True}))
            await ws.send_message(json.dumps({"type": "generate", "id": "d", "prompt": "d", "max_tokens": 4,
                                              "temperature": 0}))
            seen: dict[str, int] = {}
            final: dict[str, str] = {}
            while "b" not in final or "d" not in final:
                msg = json.loads(await ws.get_message())
                if msg["type"] == "delta":
                    seen[msg["id"]] = seen.get(msg["id"], 0) + 1
                    if msg["id"] == "b" and seen["b"] == 2:
                        await ws.send_message(json.dumps({"type": "cancel", "id": "b"}))
                else:
                    final[msg["id"]] = msg["type"]
            assert final == {"b": "cancelled", "d": "done"} and seen["a"] > 0 and seen["c"] > 0
            with trio.fail_after(1):  # b was cancelled and d is done; a and c still run
                while serving.services[0].statistics().num_live_requests != 2:
                    await trio.sleep(0.01)
        t0 = time.perf_counter()
        while (stats := serving.services[0].statistics()).num_live_requests or (
                stats.engine is not None and (stats.engine.num_running or stats.engine.num_blocks_used)):
            assert time.perf_counter() - t0 < 1.0
            await trio.sleep(0.02)
