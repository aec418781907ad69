"""`serve --mock` end to end on loopback: SSE streams from the mock engine, and the KV-events websocket."""

from __future__ import annotations

import json

import httpx
import trio
import trio_websocket

from trillm.engine.config import EngineConfig
from trillm.engine.mock import MockModelSpec, make_mock_engine
from trillm.web.config import ServerConfig
from trillm.web.server import ModelSpec, serve

SPEC = MockModelSpec(name="served-mock", vocab_size=1000, max_model_len=2048)


async def test_sse_streams_and_kv_events_websocket() -> None:
    def factory():  # type: ignore[no-untyped-def]
        return make_mock_engine(EngineConfig(num_kv_blocks=128, max_num_seqs=8), spec=SPEC, speedup=20.0)

    async with trio.open_nursery() as nursery:
        serving = await nursery.start(serve, [ModelSpec(None, factory, inline=True)], ServerConfig(port=0))
        ws_url = serving.url.replace("http", "ws", 1) + "/internal/kv-events"
        async with trio_websocket.open_websocket_url(ws_url) as ws:
            hello = json.loads(await ws.get_message())
            assert hello["type"] == "hello" and hello["model"] == "served-mock"

            async def one(client: httpx.AsyncClient, i: int, counts: list[int]) -> None:
                body = {"prompt": "shared system prompt words " * 20 + f"user {i}", "max_tokens": 9,
                        "stream": True, "ignore_eos": True}
                n = 0
                async with client.stream("POST", serving.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            n += bool(json.loads(line[6:])["choices"][0]["text"])
                counts.append(n)

            counts: list[int] = []
            async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as clients:
                for i in range(6):
                    clients.start_soon(one, client, i, counts)
            assert counts == [9] * 6
            stored, steps, last_id = 0, 0, 0
            with trio.fail_after(5):
                while steps == 0 or stored == 0:
                    msg = json.loads(await ws.get_message())
                    assert msg["type"] == "steps"
                    for rep in msg["reports"]:
                        steps += 1
                        for e in rep["kv_events"]:
                            assert e["event_id"] > last_id
                            last_id = e["event_id"]
                            stored += e["kind"] == "stored"
            assert stored > 0 and steps > 0
        async with httpx.AsyncClient(timeout=5) as client:
            with trio.fail_after(5):
                while True:  # what load tests check for leaks: nothing live, no KV block held
                    (stats,) = (await client.get(serving.url + "/stats")).json()["models"]
                    if stats["live_requests"] == 0 and stats["engine"]["running"] == 0:
                        break
                    await trio.sleep(0.01)
        assert stats["engine"]["kv_blocks_used"] == 0 and stats["engine"]["waiting"] == 0
        nursery.cancel_scope.cancel()
