"""Fixtures for the web tests: an EngineService around the fake engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
import threading
from typing import Any

import trio
import trio.testing

from trillm.web.service import EngineService, ServiceConfig
from fake_engine import FakeEngine


class FakeFactory:
    """Builds FakeEngines (on the engine thread) and remembers them, so tests can poke the live one."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        self.engines: list[FakeEngine] = []
        self.threads: list[int] = []  # the thread each engine was built on

    def __call__(self) -> FakeEngine:
        engine = FakeEngine(**self.kw)
        self.engines.append(engine)
        self.threads.append(threading.get_ident())
        return engine

    @property
    def engine(self) -> FakeEngine:
        return self.engines[-1]


@asynccontextmanager
async def running_service(factory: Callable[[], Any], **config: Any) -> AsyncIterator[EngineService]:
    async with trio.open_nursery() as nursery:
        service = await nursery.start(EngineService(factory, config=ServiceConfig(**config)).run)
        yield service
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def running_app(factory: Callable[[], Any], *, service_config: dict[str, Any] | None = None,
                      **server: Any) -> AsyncIterator[Any]:
    """A quart test client on an app around one running fake service."""
    from trillm.web.app import create_app
    from trillm.web.config import ServerConfig

    async with running_service(factory, **(service_config or {})) as service:
        app = create_app([service], ServerConfig(**server))
        yield app.test_client()


def parse_sse(data: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body (JSON-decoded, except the final "[DONE]")."""
    import json

    events = []
    for block in data.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@asynccontextmanager
async def running_server(*factories: Callable[[], Any], service_config: dict[str, Any] | None = None,
                         **server: Any) -> AsyncIterator[Any]:
    """A live hypercorn server on 127.0.0.1 (a free port); yields trillm.web.server.Serving."""
    from trillm.web.config import ServerConfig
    from trillm.web.server import serve

    config = ServerConfig(host="127.0.0.1", port=0, **server)
    async with trio.open_nursery() as nursery:
        serving = await nursery.start(partial(serve, [(None, f) for f in factories], config,
                                              service_config=ServiceConfig(**(service_config or {}))))
        yield serving
        nursery.cancel_scope.cancel()


async def read_to_eof(stream: trio.abc.Stream) -> bytes:
    chunks = []
    while data := await stream.receive_some(65536):
        chunks.append(data)
    return b"".join(chunks)


async def raw_http(url: str, request: bytes) -> bytes:
    """Send raw bytes to the server and read until it closes the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(request)
        return await read_to_eof(stream)


async def burst_completions(url: str, body: dict[str, Any], *, clients: int = 256, timeout_s: float = 30) -> list[bytes]:
    """`clients` raw HTTP/1.1 completion requests released at the same instant; their raw responses."""
    import json

    payload = json.dumps(body).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    gate = trio.Event()
    results: list[bytes] = []

    async def client() -> None:
        await gate.wait()
        results.append(await raw_http(url, request))

    with trio.fail_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(client)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    return results
