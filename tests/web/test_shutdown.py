"""SIGTERM: open streams finish within the drain timeout or end with an error event and [DONE] (SSE) or an
error message and a going-away close (websocket); the process exits within the timeout, also mid-load."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from typing import Any

import httpx
import trio
import trio_websocket

from conftest import parse_sse
from live_process import Server, trillm

async def test_sigterm_drains_open_streams_then_ends_the_rest_with_an_error() -> None:
    server = Server(trillm("--mock", "--drain-timeout", "1.5", "--max-num-seqs", "8"))
    try:
        url = await server.started()
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            results: dict[str, list[Any]] = {}
            first_token = trio.Semaphore(0)
            long = {"max_tokens": 4000, "ignore_eos": True, "stream": True}

            async def sse(name: str, body: dict[str, Any]) -> None:
                chunks = []
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        if not chunks:
                            first_token.release()
                        chunks.append(chunk)
                results[name] = parse_sse(b"".join(chunks))

            ws_messages: list[dict[str, Any]] = []
            ws_close: list[int | None] = []

            async def ws() -> None:
                async with trio_websocket.open_websocket_url(url.replace("http", "ws", 1) + "/v1/ws") as sock:
                    await sock.send_message(json.dumps({"type": "generate", "id": "g", "prompt": "w", **long}))
                    try:
                        while True:
                            msg = json.loads(await sock.get_message())
                            if not ws_messages:
                                first_token.release()
                            ws_messages.append(msg)
                    except trio_websocket.ConnectionClosed as exc:
                        ws_close.append(exc.reason.code)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(sse, f"long-{i}", {"prompt": f"long {i}", **long})
                nursery.start_soon(ws)
                for _ in range(4):
                    with trio.fail_after(30):
                        await first_token.acquire()
                # Finishes within the drain timeout.
                nursery.start_soon(sse, "short", {"prompt": "short", "max_tokens": 20, "ignore_eos": True,
                                                  "stream": True})
                await trio.sleep(0.05)
                t0 = server.terminate()
                code = await server.exit_code(timeout_s=1.5 + 6)
                elapsed = time.perf_counter() - t0
        assert code == 0, "".join(server.log)
        assert 1.4 < elapsed < 1.5 + 4, elapsed
        short = results["short"]
        assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
        for i in range(3):
            events = results[f"long-{i}"]
            assert events[-1] == "[DONE]", events[-3:]
            assert events[-2]["error"]["code"] == "shutting_down", events[-2]
        assert ws_messages[-1]["type"] == "error" and ws_messages[-1]["error"]["code"] == "shutting_down"
        assert ws_close == [1001]
        assert any("shutting down" in line for line in server.log)
    finally:
        server.kill()


async def test_a_new_request_while_draining_gets_a_clean_503() -> None:
    server = Server(trillm("--mock", "--drain-timeout", "3"))
    try:
        url = await server.started()
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
                await r.aiter_bytes().__anext__()
                # A second, idle keep-alive connection of the same client: reused after the signal.
                async with httpx.AsyncClient(base_url=url, timeout=30) as other:
                    assert (await other.get("/health")).status_code == 200
                    server.terminate()
                    await server.wait_until("shutting down")
                    # Its idle connection was closed and the listening socket too: refused at once, never
                    # a connection accepted and left without an answer.
                    with trio.fail_after(2):
                        try:
                            late = await other.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
                        except httpx.ConnectError:
                            late = None
                    if late is not None:
                        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
                        assert "Retry-After" in late.headers
                    # A new connection is refused at once.
                    with trio.fail_after(2):
                        async with httpx.AsyncClient(base_url=url) as fresh:
                            try:
                                await fresh.get("/health")
                                raise AssertionError("accepted while shutting down")
                            except httpx.ConnectError:
                                pass
        assert await server.exit_code(timeout_s=3 + 6) == 0
    finally:
        server.kill()


SLOW_LOAD = textwrap.dedent("""
    import sys
    from conftest import MockFactory
    from trillm.web.cli.serve import serve_until_stopped
    from trillm.web.config import ServerConfig
    from trillm.web.server import ModelSpec
    from trillm.web.service.engine_service import ServiceConfig
    import logging
    logging.basicConfig(level="INFO", format="%(name)s: %(message)s")
    lazy = sys.argv[1] == "lazy"
    if not lazy:
        print("loading the model", flush=True)
    code = serve_until_stopped([ModelSpec("slow", MockFactory(load_delay=120))], ServerConfig(port=0, drain_timeout_s=5),
                               ServiceConfig(lazy_load=lazy))
    print("exit", code, flush=True)
    sys.exit(code)
""")


async def test_sigterm_during_the_initial_model_load_exits_at_once() -> None:
    server = Server([sys.executable, "-c", SLOW_LOAD, "eager"])
    try:
        await server.wait_until("loading the model")
        await trio.sleep(0.5)  # the engine thread is inside the (two-minute) load
        t0 = server.terminate()
        code = await server.exit_code(timeout_s=10)
        assert code == 0 and time.perf_counter() - t0 < 5, "".join(server.log)
        assert any("shutting down while loading" in line for line in server.log)
    finally:
        server.kill()


async def test_sigterm_during_a_lazy_load_answers_the_waiting_request_and_exits() -> None:
    server = Server([sys.executable, "-c", SLOW_LOAD, "lazy"])
    try:
        url = await server.started()
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            responses: list[httpx.Response] = []

            async def request() -> None:
                responses.append(await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(request)
                with trio.fail_after(10):
                    while (await client.get("/health")).json()["models"]["slow"]["state"] != "loading":
                        await trio.sleep(0.05)
                t0 = server.terminate()
            (r,) = responses
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert time.perf_counter() - t0 < 2
        code = await server.exit_code(timeout_s=10)
        assert code == 0 and time.perf_counter() - t0 < 6, "".join(server.log)
    finally:
        server.kill()

