"""cache_salt through `trillm route`, on every surface it proxies (chat, completions, Messages, Responses, the
websocket): the salt reaches the replica (whose prefix cache then keeps salts apart: its own usage says so),
and the router predicts hits only under the same salt."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
import trio_websocket

from test_router import CONFIG, routing, start_replica, wait_synced

SYSTEM = "you know a great deal about rivers lakes and the sea " * 12  # many blocks


def body_of(surface: str, salt: str | None) -> dict[str, Any]:
    salted = {} if salt is None else {"cache_salt": salt}
    if surface in ("chat", "ws"):
        return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the longest?"}],
                "max_tokens": 2, **salted}
    if surface == "completions":
        return {"prompt": SYSTEM + " the longest?", "max_tokens": 2, **salted}
    if surface == "messages":
        return {"model": "mock-model", "max_tokens": 2, "system": SYSTEM,
                "messages": [{"role": "user", "content": "the longest?"}], **salted}
    return {"model": "mock-model", "max_output_tokens": 2, "instructions": SYSTEM, "input": "the longest?", **salted}


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
         "responses": "/v1/responses"}


def cached_tokens(surface: str, usage: dict[str, Any]) -> int:
    """What the replica's prefix cache served, in each API's own words."""
    if surface == "messages":
        return int(usage["cache_read_input_tokens"])
    if surface == "responses":
        return int(usage["input_tokens_details"]["cached_tokens"])
    return int(usage["prompt_tokens_details"]["cached_tokens"])


async def send(client: httpx.AsyncClient, url: str, surface: str, body: dict[str, Any]) -> int:
    if surface == "ws":
        async with trio_websocket.open_websocket_url(url.replace("http", "ws", 1) + "/v1/ws") as ws:
            await ws.send_message(json.dumps({"type": "generate", "id": "g", **body}))
            with trio.fail_after(20):
                while (msg := json.loads(await ws.get_message()))["type"] != "done":
                    assert msg["type"] == "delta", msg
            return cached_tokens(surface, msg["usage"])
    resp = await client.post(url + PATHS[surface], json=body)
    assert resp.status_code == 200, resp.text
    return cached_tokens(surface, resp.json()["usage"])


async def test_salted_prompts_hit_only_under_their_salt_through_the_router() -> None:
    async with trio.open_nursery() as nursery:
        replica = await start_replica(nursery)  # one replica: a miss can only come from the salt
        async with routing([replica.url]) as r, httpx.AsyncClient(timeout=30) as client:
            await wait_synced(r, 1)

            async def predicted() -> int:
                return int((await client.get(r.url + "/stats")).json()["predicted_cached_blocks"])

            for surface in ("chat", "completions", "messages", "responses", "ws"):
                salt_a, salt_b = f"{surface}-A", f"{surface}-B"  # fresh salts: nothing cached under them yet
                seen = []
                for salt in (salt_a, salt_b, None, salt_a):
                    before = await predicted()
                    served = await send(client, r.url, surface, body_of(surface, salt))
                    seen.append((salt, await predicted() - before, served))
                    await trio.sleep(0.3)  # the replica's KV events reach the router's index
                (_, pa, ca), (_, pb, cb), (_, pn, cn), (_, pa2, ca2) = seen
                # The first of each salt: nothing predicted, nothing served; the salt's second: both hit, and
                # the router predicted exactly the blocks the replica served.
                assert (pa, ca, pb, cb) == (0, 0, 0, 0), (surface, seen)
                assert ca2 > 0 and pa2 * CONFIG.block_size == ca2, (surface, seen)
                # Unsalted, the chat-templated prompt may hit the earlier surfaces' unsalted blocks, never the
                # salted ones: what the router predicts is what the replica serves.
                assert pn * CONFIG.block_size == cn, (surface, seen)
        nursery.cancel_scope.cancel()
