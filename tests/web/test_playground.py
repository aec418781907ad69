"""The playground's server side: the page and its assets, /stats, and the websocket's subprotocol API key.

(The page itself runs in a real browser in test_playground_browser.py.)
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import httpx
import pytest
import trio_websocket
from hypothesis import given, strategies as st

from trillm.web.http.keys import subprotocol_api_key
from trillm.web.playground import CONTENT_SECURITY_POLICY

from conftest import MockFactory, running_app, running_server

STATIC = Path(__file__).resolve().parents[2] / "web" / "static"


def bearer_subprotocol(key: str) -> str:
    """What the page sends: the key's UTF-8 bytes, base64url without padding."""
    return "trillm.bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


async def test_root_serves_the_page_and_its_assets_with_a_strict_policy() -> None:
    async with running_app(MockFactory()) as client:
        page = await client.get("/")
        assert page.status_code == 200 and page.content_type.startswith("text/html")
        assert page.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "connect-src 'self'" in CONTENT_SECURITY_POLICY
        html = (await page.get_data()).decode()
        refs = re.findall(r'(?:src|href)="([^"]*)"', html)
        assert "/static/playground.js" in refs and "/static/playground.css" in refs
        for ref in refs:  # same origin only: no CDN, works offline
            assert ref.startswith("data:") or (ref.startswith("/") and not ref.startswith("//")), ref
        for name, kind in (("playground.js", "javascript"), ("playground.css", "text/css")):
            asset = await client.get(f"/static/{name}")
            assert asset.status_code == 200 and kind in asset.content_type
            assert (await asset.get_data()) == (STATIC / name).read_bytes()


def test_the_page_fetches_nothing_from_elsewhere() -> None:
    """(The policy above would block it in the browser anyway; this keeps the files honest.)"""
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), path
    css = (STATIC / "playground.css").read_text()
    assert "@import" not in css and "url(" not in css


def test_model_output_never_reaches_innerHTML() -> None:
    js = (STATIC / "playground.js").read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", js)


async def test_stats_reports_each_model_and_changes_with_requests() -> None:
    async with running_app(MockFactory()) as client:
        before = await (await client.get("/stats")).get_json()
        (model,) = before["models"]
        assert model["model"] == "mock-model" and model["state"] == "ready" and model["requests"] == {}
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
        assert r.status_code == 200
        after = (await (await client.get("/stats")).get_json())["models"][0]
        assert after["requests"] == {"length": 1}
        engine = after["engine"]
        assert engine["running"] == 0 and engine["waiting"] == 0 and engine["kv_blocks_total"] == 511
        assert after["live_requests"] == 0 and after["steps"] > before["models"][0]["steps"]
        assert engine["prefix_cache_queries"] > 0 and 0.0 <= engine["prefix_cache_hit_rate"] <= 1.0


@given(st.text(min_size=1, max_size=64))
def test_subprotocol_key_round_trips_any_key(key: str) -> None:
    protocol = bearer_subprotocol(key)
    assert re.fullmatch(r"[A-Za-z0-9._-]+", protocol)  # a valid subprotocol token, as browsers require
    assert subprotocol_api_key(["trillm", protocol]) == key.encode()


def test_subprotocol_key_absent_or_malformed() -> None:
    assert subprotocol_api_key([]) is None and subprotocol_api_key(["trillm", "chat"]) is None
    assert subprotocol_api_key(["trillm.bearer.a"]) is None  # one base64 character is never valid


async def ws_generate(url: str, **connect: object) -> tuple[str | None, list[dict[str, object]]]:
    async with trio_websocket.open_websocket_url(url, **connect) as ws:  # type: ignore[arg-type]
        await ws.send_message(json.dumps({"type": "generate", "id": 1, "prompt": "hi", "max_tokens": 3}))
        msgs = []
        while not msgs or msgs[-1]["type"] not in ("done", "error"):
            msgs.append(json.loads(await ws.get_message()))
        return ws.subprotocol, msgs


@pytest.mark.parametrize("api_key", [None, "k/+=ey", "clé ü"])
async def test_websocket_takes_the_api_key_as_a_subprotocol(api_key: str | None) -> None:
    async with running_server(MockFactory(), api_key=api_key) as serving:
        url = serving.url.replace("http", "ws", 1) + "/v1/ws"
        key = api_key or "anything"
        protocol, msgs = await ws_generate(url, subprotocols=["trillm", bearer_subprotocol(key)])
        assert protocol == "trillm" and msgs[-1]["type"] == "done"
        if api_key is None:
            protocol, msgs = await ws_generate(url)
            assert protocol is None and msgs[-1]["type"] == "done"
            return
        if api_key.isascii():  # (a header is read as latin-1: only an ASCII key survives it)
            header = [(b"Authorization", b"Bearer " + api_key.encode())]
            assert (await ws_generate(url, extra_headers=header))[1][-1]["type"] == "done"
        for subprotocols in (["trillm"], ["trillm", bearer_subprotocol("wrong")], ["trillm", "trillm.bearer.!"]):
            with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                await ws_generate(url, subprotocols=subprotocols)
            assert rejected.value.status_code == 401
        async with httpx.AsyncClient(base_url=serving.url) as client:  # the page itself needs no key
            assert (await client.get("/")).status_code == 200
            assert (await client.get("/stats")).status_code == 200
            assert (await client.get("/v1/models")).status_code == 401
