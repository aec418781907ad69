"""The trio shell around each replica: health checks, model discovery and one KV-event subscription per model.

`ReplicaMonitor.run` owns one nursery per replica: the check loop (GET /health every interval; GET /v1/models
when the replica (re)joins the pool) and a subscriber task per model it serves. A subscriber reads the
replica's /internal/kv-events stream into the Router; when the stream breaks (a gap in event ids, a new
epoch, "dropped", a lost connection) the worker's index is cleared and the subscriber reconnects, and the
new stream's hello starts the index again.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import quote

import httpx
import trio
import trio_websocket

from trillm.engine.kv_events import StepReport
from trillm.web.router.core import Hello, Router, WorkerKey
from trillm.web.router.tokenizers import PromptSource

log = logging.getLogger("trillm.web.router")


def failure_reason(exc: BaseException) -> str:
    """A short fixed phrase for why a replica could not be reached, for /health and /stats; the exception's
    own text (addresses, OS messages, a replica's error body) goes to the log only."""
    if isinstance(exc, (trio.TooSlowError, httpx.TimeoutException, trio_websocket.ConnectionTimeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, (httpx.ConnectError, ConnectionRefusedError)):
        return "could not connect"
    if isinstance(exc, trio_websocket.HandshakeError):
        return "websocket handshake refused"
    if isinstance(exc, (trio_websocket.ConnectionClosed, httpx.RemoteProtocolError, httpx.ReadError,
                        ConnectionError)):
        return "connection lost"
    return "unreachable"


class ReplicaMonitor:
    def __init__(self, url: str, router: Router, client: httpx.AsyncClient, prompts: PromptSource, *,
                 headers: dict[str, str], interval_s: float, timeout_s: float, max_backoff_s: float) -> None:
        self.url = url
        self.router = router
        self.client = client
        self.prompts = prompts
        self.headers = headers
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.model_entries: list[dict[str, Any]] = []  # the replica's /v1/models data, as it last answered
        self._subscriptions: dict[str, trio.CancelScope] = {}
        self._checked = trio.Event()
        self._nursery: trio.Nursery | None = None

    async def wait_checked(self) -> None:
        """Until the first health check has finished (whatever it found)."""
        await self._checked.wait()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while True:
                await self.check_once(nursery)
                self._checked.set()
                await trio.sleep(self.interval_s)

    async def check_once(self, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        try:
            with trio.fail_after(self.timeout_s):
                r = await self.client.get(self.url + "/health", headers=self.headers)
            ok, reason = r.status_code == 200, f"/health answered {r.status_code}"
            detail = reason
        except (httpx.HTTPError, trio.TooSlowError, OSError) as exc:
            ok, reason = False, f"/health: {failure_reason(exc)}"
            detail = f"/health: {exc!r}"
        rejoined = self.router.on_health(self.url, ok, now, reason)
        if not ok:
            if rejoined:
                log.warning("replica %s left the pool: %s", self.url, detail)
            return
        if rejoined or not self.router.replicas[self.url].models:
            if await self.discover(nursery):
                log.info("replica %s is in the pool (models: %s)", self.url,
                         ", ".join(self.router.replicas[self.url].models))

    async def discover(self, nursery: trio.Nursery) -> bool:
        """Read the replica's models and (un)subscribe accordingly; False if it did not answer."""
        try:
            with trio.fail_after(self.timeout_s):
                r = await self.client.get(self.url + "/v1/models", headers=self.headers)
            data = r.json()["data"] if r.status_code == 200 else None
        except (httpx.HTTPError, trio.TooSlowError, OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("replica %s: GET /v1/models failed: %r", self.url, exc)
            return False
        if not isinstance(data, list):
            log.warning("replica %s: GET /v1/models answered %s", self.url, r.status_code)
            return False
        self.model_entries = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        added, removed = self.router.set_models(self.url, [m["id"] for m in self.model_entries])
        for key in removed:
            self._subscriptions.pop(key.model).cancel()
        for key in added:
            scope = trio.CancelScope()
            self._subscriptions[key.model] = scope
            nursery.start_soon(self._subscribe, key, scope)
        return True

    async def _subscribe(self, key: WorkerKey, scope: trio.CancelScope) -> None:
        ws_url = "ws" + self.url[len("http"):] + "/internal/kv-events?model=" + quote(key.model)
        headers = [(k.encode(), v.encode()) for k, v in self.headers.items()]
        backoff = 0.05
        with scope:
            while True:
                try:
                    async with trio_websocket.open_websocket_url(ws_url, extra_headers=headers,
                                                                 connect_timeout=self.timeout_s,
                                                                 disconnect_timeout=1.0) as ws:
                        if await self._follow(key, ws):
                            backoff = 0.05
                except (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed,
                        trio_websocket.ConnectionTimeout, trio_websocket.DisconnectionTimeout) as exc:
                    log.debug("kv-events %s: %r", key, exc)
                self.router.on_stream_lost(key)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    async def _follow(self, key: WorkerKey, ws: trio_websocket.WebSocketConnection) -> bool:
        """Read one stream until it breaks; True if it had started (a hello came)."""
        try:
            hello = json.loads(await ws.get_message())
            if hello.get("type") != "hello":
                log.warning("kv-events %s: %s", key, hello.get("message", hello))
                return False
            self.router.on_hello(key, Hello.from_json(hello))
            if self._nursery is not None:
                self._nursery.start_soon(self.prompts.verify, key)
            while True:
                msg = json.loads(await ws.get_message())
                kind = msg.get("type")
                if kind == "steps":
                    reports = [StepReport.from_json(r) for r in msg["reports"]]
                    if not self.router.on_steps(key, int(msg["epoch"]), reports):
                        log.info("kv-events %s: resync (event gap or new epoch)", key)
                        return True
                elif kind == "dropped":
                    log.info("kv-events %s: the replica dropped this router (it fell behind); resync", key)
                    return True
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("kv-events %s: malformed message: %r", key, exc)
        return True
