"""The key live-server tests against the real LLMEngine with the tiny random model (tests/conftest.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
import trio_websocket

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.outputs import EngineStatistics
from trillm.web.service.engine_service import EngineService

from conftest import parse_sse, running_server


def engine_stats(service: EngineService) -> EngineStatistics:
    stats = service.statistics().engine
    assert stats is not None
    return stats

MESSAGES = [{"role": "user", "content": "What is two plus two? Please answer in a short sentence, " * 3}]


class RealFactory:
    """Builds an LLMEngine on the engine thread; `fail` makes its next step raise (injected failure)."""

    def __init__(self, path: Path, **config: Any) -> None:
        self.config = EngineConfig(model=str(path), **{"max_num_seqs": 32, "num_kv_blocks": 512,
                                                       "max_num_batched_tokens": 256, **config})
        self.fail = False
        self.engines: list[LLMEngine] = []

    def __call__(self) -> LLMEngine:
        factory = self

        class Engine(LLMEngine):
            def step(self, **kw: Any) -> Any:
                if factory.fail:
                    factory.fail = False
                    raise RuntimeError("injected engine failure")
                return super().step(**kw)

        engine = Engine(self.config)
        self.engines.append(engine)
        return engine


async def stream_text(client: httpx.AsyncClient, req: dict[str, Any]) -> str:
    r = await client.post("/v1/completions", json={**req, "stream": True})
    assert r.status_code == 200, r.text
    events = parse_sse(r.content)
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


async def test_32_concurrent_greedy_streams_equal_sequential(tiny_model_path: Path) -> None:
    async with running_server(RealFactory(tiny_model_path)) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            reqs = [{"prompt": f"Hello {i} world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                    for i in range(32)]
            sequential = [await stream_text(client, r) for r in reqs]
            concurrent: dict[int, str] = {}

            async def one(i: int) -> None:
                concurrent[i] = await stream_text(client, reqs[i])

            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(one, i)
    assert [concurrent[i] for i in range(32)] == sequential
    assert len(set(sequential)) > 1


async def test_disconnect_frees_kv_blocks_within_1s(tiny_model_path: Path) -> None:
    async with running_server(RealFactory(tiny_model_path)) as serving:
        service = serving.services[0]
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            req = {"prompt": "Once upon a time " * 8, "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=req) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: {")
                    if n >= 4:
                        break
                assert engine_stats(service).num_blocks_used > 0
            t0 = time.perf_counter()
            while (s := engine_stats(service)).num_blocks_used or s.num_running:
                assert time.perf_counter() - t0 < 1.0
                await trio.sleep(0.01)


def sdk_calls(base_url: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    out: dict[str, Any] = {"model": model}
    out["chat"] = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 extra_body={"ignore_eos": True})
    out["chat_stream"] = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    out["completion"] = client.completions.create(model=model, prompt="The capital of", max_tokens=5, temperature=0,
                                                  extra_body={"ignore_eos": True})
    out["completion_stream"] = list(client.completions.create(
        model=model, prompt="The capital of", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    return out


async def test_openai_sdk_against_the_real_engine(tiny_model_path: Path) -> None:
    async with running_server(RealFactory(tiny_model_path)) as serving:
        out = await trio.to_thread.run_sync(sdk_calls, serving.url)
    chat = out["chat"]
    stream_text = "".join(c.choices[0].delta.content or "" for c in out["chat_stream"] if c.choices)
    assert chat.choices[0].message.content == stream_text and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 6
    usage = out["chat_stream"][-1].usage
    assert usage.prompt_tokens == chat.usage.prompt_tokens and usage.completion_tokens == 6
    # the same prompt again: its full blocks come from the prefix cache
    assert usage.prompt_tokens > 32 and usage.prompt_tokens_details.cached_tokens >= 16
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    comp_stream = "".join(c.choices[0].text for c in out["completion_stream"] if c.choices)
    assert out["completion"].choices[0].text == comp_stream
    assert out["completion_stream"][-1].usage.completion_tokens == 5


async def test_websocket_multiplex_and_cancel_real(tiny_model_path: Path) -> None:
    async with running_server(RealFactory(tiny_model_path)) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            solo = await stream_text(client, {"prompt": "two", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        ws_url = serving.url.replace("http", "ws", 1) + "/v1/ws"
        async with trio_websocket.open_websocket_url(ws_url) as ws:
            await ws.send_message(json.dumps({"type": "generate", "id": 1, "prompt": "one", "max_tokens": 300,
                                              "ignore_eos": True}))
            await ws.send_message(json.dumps({"type": "generate", "id": 2, "prompt": "two", "max_tokens": 8,
                                              "temperature": 0, "ignore_eos": True}))
            texts = {1: "", 2: ""}
            final: dict[int, dict[str, Any]] = {}
            while len(final) < 2:
                msg = json.loads(await ws.get_message())
                if msg["type"] == "delta":
                    texts[msg["id"]] += msg["text"]
                    if msg["id"] == 2 and msg["finish_reason"]:
                        await ws.send_message(json.dumps({"type": "cancel", "id": 1}))
                else:
                    final[msg["id"]] = msg
        assert final[1]["type"] == "cancelled" and final[2]["type"] == "done"
        assert texts[2] == solo and final[2]["usage"]["completion_tokens"] == 8
        t0 = time.perf_counter()
        while engine_stats(serving.services[0]).num_blocks_used:
            assert time.perf_counter() - t0 < 1.0
            await trio.sleep(0.01)


async def test_injected_failure_ends_open_streams_real(tiny_model_path: Path) -> None:
    factory = RealFactory(tiny_model_path)
    async with running_server(factory, service_config={"restart_backoff_s": 0.05}) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            started = trio.Semaphore(0)
            bodies: list[bytes] = []

            async def one(i: int) -> None:
                req = {"prompt": f"story {i}", "max_tokens": 1000, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=req) as r:
                    chunks: list[bytes] = []
                    async for chunk in r.aiter_bytes():
                        if not chunks:
                            started.release()
                        chunks.append(chunk)
                    bodies.append(b"".join(chunks))

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i)
                    for _ in range(4):
                        await started.acquire()
                    factory.fail = True
            assert len(bodies) == 4
            for body in bodies:
                events = parse_sse(body)
                assert events[-1] == "[DONE]" and "the engine failed" in events[-2]["error"]["message"]
            with trio.fail_after(20):
                while (await client.get("/health")).status_code != 200:
                    await trio.sleep(0.05)
            assert len(factory.engines) == 2
            assert await stream_text(client, {"prompt": "ok", "max_tokens": 2, "ignore_eos": True})


async def test_256_simultaneous_clients_real(tiny_model_path: Path) -> None:
    from conftest import burst_completions

    async with running_server(RealFactory(tiny_model_path)) as serving:
        results = await burst_completions(
            serving.url, {"prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}, timeout_s=60)
    assert len(results) == 256 and all(r.startswith(b"HTTP/1.1 200") for r in results)
    texts = {json.loads(r.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"] for r in results}
    assert len(texts) == 1  # same greedy prompt, same answer


def test_cli_generate_streams_the_answer(tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trillm.web.cli import main

    assert main(["generate", "--model", str(tiny_model_path), "--max-tokens", "6", "--temperature", "0",
                 "Hello"]) == 0
    out = capsys.readouterr()
    assert "loading" in out.err and "generated" in out.err and out.out.endswith("\n")


async def test_kv_events_and_load_on_a_websocket(tiny_model_path: Path) -> None:
    async with running_server(RealFactory(tiny_model_path)) as serving:
        ws_url = serving.url.replace("http", "ws", 1) + "/internal/kv-events"
        async with trio_websocket.open_websocket_url(ws_url) as ws:
            hello = json.loads(await ws.get_message())
            assert hello["type"] == "hello" and hello["model"] == serving.services[0].model_name
            async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
                text = await stream_text(client, {"prompt": "the same long prompt " * 12, "max_tokens": 4})
            assert text
            stored, last_id, loads = 0, 0, []
            with trio.fail_after(5):
                while not stored or not loads:
                    msg = json.loads(await ws.get_message())
                    assert msg["type"] == "steps"
                    for rep in msg["reports"]:
                        loads.append(rep["load"])
                        for e in rep["kv_events"]:
                            assert e["event_id"] > last_id  # monotonically increasing ids
                            last_id = e["event_id"]
                            stored += e["kind"] == "stored"
            assert stored >= 3  # the prompt's full blocks entered the prefix cache
            assert {"num_running", "num_waiting", "num_blocks_used"} <= loads[0].keys()


async def test_health_reports_the_load_time_model_check(tiny_model_path: Path) -> None:
    async with running_server(RealFactory(tiny_model_path)) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            body = (await client.get("/health")).json()
    (state,) = body["models"].values()
    check = state["model_check"]
    assert check["verified"] is True and check["allowed_anyway"] is False
    assert check["tokens_compared"] > 0 and check["max_logprob_diff"] < 0.02 and "mlx-lm" in check["detail"]
