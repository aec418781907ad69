"""`trillm route` against hostile input: a websocket frame a replica would refuse is refused by the router with
the client's id (nothing hangs, nothing stays in flight), an oversized replica message fails only its own
generation, deep nesting through the proxy is a clean 400, /stats/reset needs the key and refuses other
sites' pages, /health and /stats show no exception text, and `trillm route` warns when it lends its replica
key to anyone."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio_websocket

from test_router import mock_factory, routing, start_replica, wait_synced
from trillm.bench.harness.servers import free_port
from trillm.web.cli.route import open_relay_warning
from trillm.web.config import ServerConfig
from trillm.web.router.app import Routing, route
from trillm.web.router.config import RouterConfig
from trillm.web.ws.envelope import BadMessage, encode_message, parse_message

LONE_SURROGATE = '{"type": "generate", "id": "g1", "prompt": "a \\ud800 b", "max_tokens": 2}'


def test_the_shared_envelope_parser() -> None:
    with pytest.raises(BadMessage) as info:
        parse_message(LONE_SURROGATE)
    assert info.value.gid == "g1" and info.value.error.status == 400
    with pytest.raises(BadMessage) as info:  # an id that is itself a lone surrogate cannot be sent back
        parse_message('{"type": "cancel", "id": "\\udc00"}')
    assert info.value.gid is None
    with pytest.raises(BadMessage) as info:
        parse_message('{"id": 1, "x": ' + "[" * 50_000 + "]" * 50_000 + "}")
    assert info.value.gid is None  # (the lenient parse gives up too: RecursionError, not a crash)
    assert parse_message('{"type": "cancel", "id": 7}') == ({"type": "cancel", "id": 7}, 7)
    with pytest.raises(BadMessage, match="'id'"):
        parse_message('{"type": "cancel", "id": true}')
    with pytest.raises(Exception, match="message_too_large|over the"):
        encode_message({"type": "delta", "text": "x" * (17 << 20)})


async def ws_messages(ws: trio_websocket.WebSocketConnection, until: set[Any], timeout: float = 20) -> dict[Any, Any]:
    """Read messages until each id in `until` has ended (done, cancelled or error); the last message of each."""
    ended: dict[Any, Any] = {}
    with trio.fail_after(timeout):
        while not until <= set(ended):
            msg = json.loads(await ws.get_message())
            if msg["type"] in ("done", "cancelled", "error"):
                ended[msg["id"]] = msg
    return ended


async def inflight(r: Routing) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        stats = (await client.get(r.url + "/stats")).json()
    return [w["inflight"] for rep in stats["replicas"] for w in rep["workers"]]


async def test_a_lone_surrogate_is_refused_by_the_router_with_the_clients_id() -> None:
    async with trio.open_nursery() as nursery:
        replica = await start_replica(nursery)
        async with routing([replica.url]) as r:
            await wait_synced(r, 1)
            for url in (replica.url, r.url):  # a replica and the router answer alike
                async with trio_websocket.open_websocket_url(url.replace("http", "ws", 1) + "/v1/ws") as ws:
                    await ws.send_message(LONE_SURROGATE)
                    await ws.send_message(json.dumps({"type": "generate", "id": "ok", "prompt": "x", "max_tokens": 3}))
                    ended = await ws_messages(ws, {"g1", "ok"}, timeout=10)
                    assert ended["g1"]["type"] == "error" and ended["g1"]["error"]["code"] is None
                    assert "not valid JSON" in ended["g1"]["error"]["message"]
                    assert ended["ok"]["type"] == "done"
            assert await inflight(r) == [0]
        nursery.cancel_scope.cancel()


async def test_an_oversized_replica_message_fails_only_its_own_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    import trillm.web.router.ws as router_ws
    import trillm.web.ws.envelope as ws_protocol

    # A smaller bound on both sides, so the test needs a 1.2 MB delta and not a 16 MB one; the delta is still
    # past the 1 MiB a websocket client accepts by default (trio-websocket's, which the router used to keep).
    monkeypatch.setattr(ws_protocol, "MAX_SEND_BYTES", 256 << 10)
    monkeypatch.setattr(router_ws, "MAX_SEND_BYTES", 256 << 10)
    async with trio.open_nursery() as nursery:
        replica = await start_replica(nursery)
        async with routing([replica.url]) as r:
            await wait_synced(r, 1)
            async with trio_websocket.open_websocket_url(r.url.replace("http", "ws", 1) + "/v1/ws") as ws:
                await ws.send_message(json.dumps({"type": "generate", "id": "steady", "prompt": "go",
                                                  "max_tokens": 300, "ignore_eos": True}))
                await ws.send_message(json.dumps({"type": "generate", "id": "huge", "prompt": list(range(10, 1210)),
                                                  "max_tokens": 2, "prompt_logprobs": 20}))
                ended = await ws_messages(ws, {"steady", "huge"}, timeout=60)
            assert ended["huge"]["type"] == "error" and ended["huge"]["error"]["code"] == "message_too_large"
            assert "256 KiB" not in ended["huge"]["error"]["message"] and "bytes" in ended["huge"]["error"]["message"]
            assert ended["steady"]["type"] == "done"  # its socket to the replica was never closed
            assert await inflight(r) == [0]
            async with httpx.AsyncClient(timeout=30) as client:
                stats = (await client.get(r.url + "/stats")).json()
            assert stats["retries"].get("dropped", 0) == 0 and stats["replicas"][0]["health"] == "healthy"
        nursery.cancel_scope.cancel()


async def test_deep_nesting_through_the_proxy_is_a_clean_400() -> None:
    async with trio.open_nursery() as nursery:
        replica = await start_replica(nursery)
        async with routing([replica.url]) as r, httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 1)
            deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/tokenize"):
                resp = await client.post(r.url + path, content=deep, headers={"content-type": "application/json"})
                assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])
                assert "error" in resp.json()
            lone = '{"prompt": "a \\ud800", "max_tokens": 2}'
            resp = await client.post(r.url + "/v1/completions", content=lone,
                                     headers={"content-type": "application/json"})
            assert resp.status_code == 400, resp.text
        nursery.cancel_scope.cancel()


async def test_stats_reset_needs_the_key_and_refuses_other_sites() -> None:
    async with trio.open_nursery() as nursery:
        replica = await start_replica(nursery)
        for key in (None, "front-key"):
            config = RouterConfig((replica.url,), ServerConfig(port=0, api_key=key), health_interval_s=0.1)
            async with trio.open_nursery() as inner:
                r: Routing = await inner.start(route, config)
                auth = {} if key is None else {"Authorization": f"Bearer {key}"}
                async with httpx.AsyncClient(base_url=r.url, timeout=30) as client:
                    if key is not None:
                        resp = await client.post("/stats/reset")
                        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
                    resp = await client.post("/stats/reset", headers={**auth, "Origin": "http://evil.test"})
                    assert resp.status_code == 403 and resp.json()["error"]["code"] == "origin_not_allowed"
                    resp = await client.post("/stats/reset", headers=auth)
                    assert resp.status_code == 200 and resp.json() == {"reset": True}
                inner.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_health_and_stats_show_a_short_reason_not_exception_text() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with trio.open_nursery() as nursery:
        replica = await start_replica(nursery)
        async with routing([replica.url, dead]) as r, httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 1)
            with trio.fail_after(10):
                while (health := (await client.get(r.url + "/health")).json())["replicas"][dead]["reason"] in (
                        None, "not checked yet"):
                    await trio.sleep(0.05)
            reason = health["replicas"][dead]["reason"]
            stats = (await client.get(r.url + "/stats")).json()
            assert reason == "/health: could not connect"
            assert [rep["reason"] for rep in stats["replicas"] if rep["url"] == dead] == [reason]
            # A request that finds it refusing connections reports it the same way.
            for _ in range(4):
                assert (await client.post(r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
                        ).status_code == 200
            text = json.dumps((await client.get(r.url + "/stats")).json())
            assert "Errno" not in text and "Error(" not in text and "Connect" not in text
        nursery.cancel_scope.cancel()


def test_route_warns_when_it_lends_its_replica_key_to_anyone() -> None:
    assert open_relay_warning("0.0.0.0", None, "replica-key") is not None
    assert "--api-key" in (open_relay_warning("10.0.0.5", None, "k") or "")
    assert open_relay_warning("router.example", None, "k") is not None
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert open_relay_warning(host, None, "k") is None, host
    assert open_relay_warning("0.0.0.0", "front-key", "k") is None
    assert open_relay_warning("0.0.0.0", None, None) is None
