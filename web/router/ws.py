"""The /v1/ws websocket through the router: each generation goes to its own best replica.

A client socket multiplexes generations by id (web/ws/session.py has the protocol). The router reads each message
with the replicas' own parser (web/ws/envelope.py), answers malformed ones itself (as a replica would, with
the client's id where it can be read), and sends each `generate` to the replica its prompt
should go to, over one upstream socket per replica that this client uses; `cancel` follows its generation.
Replica messages go back verbatim. A generation that has not streamed a delta yet moves to another replica
when its replica refuses it as overloaded or unavailable, or when the upstream socket dies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio
import trio_websocket

from trillm.web.errors import APIError, to_api_error
from trillm.web.router.core import Assignment, Router
from trillm.web.router.metrics import RouterMetrics
from trillm.web.router.prompt import ws_request
from trillm.web.router.proxy import request_model, request_salt
from trillm.web.router.replica import failure_reason
from trillm.web.router.tokenizers import PromptSource
from trillm.web.ws.envelope import BadMessage, MAX_SEND_BYTES, encode_message, parse_message, refusal

log = logging.getLogger("trillm.web.router")

RETRY_CODES = frozenset({"overloaded", "model_unavailable"})


@dataclass(eq=False, slots=True)
class _Generation:
    gid: str | int
    raw: str  # the client's generate message, forwarded as it came (its cache_salt with it)
    model: str | None
    token_ids: list[int] | None
    cache_salt: str | None = None
    tried: list[str] = field(default_factory=list)
    assignment: Assignment | None = None
    started: bool = False  # a delta went to the client: it can no longer move


@dataclass(eq=False, slots=True)
class _Upstream:
    url: str
    ws: trio_websocket.WebSocketConnection


class WSSession:
    """One client socket. Its tasks (a writer, one reader per upstream) live in the handler's nursery."""

    def __init__(self, nursery: trio.Nursery, out: trio.MemorySendChannel[str], router: Router,
                 prompts: PromptSource, metrics: RouterMetrics, *, headers: list[tuple[bytes, bytes]],
                 max_generations: int, connect_timeout_s: float) -> None:
        self.nursery = nursery
        self.out = out
        self.router = router
        self.prompts = prompts
        self.metrics = metrics
        self.headers = headers
        self.max_generations = max_generations
        self.connect_timeout_s = connect_timeout_s
        self.active: dict[str, _Generation] = {}
        self._upstreams: dict[str, _Upstream] = {}
        self._opening: dict[str, trio.Lock] = {}

    async def send(self, msg: dict[str, Any]) -> None:
        await self.out.send(encode_message(msg))

    async def error(self, gid: object, exc: BaseException) -> None:
        await self.send({"type": "error", "id": gid, "error": to_api_error(exc).body()["error"]})

    async def on_message(self, raw: str | bytes) -> None:
        try:
            # The replicas' own parser: a message they would refuse (a lone surrogate, deep nesting) is refused
            # here, never forwarded to come back as an error the router cannot match to its generation.
            msg, gid = parse_message(raw)
        except BadMessage as exc:
            await self.error(exc.gid, exc.error)
            return
        key = str(gid)
        text = raw if isinstance(raw, str) else raw.decode()
        if (refused := refusal(msg, gid, self.active, self.max_generations)) is not None:
            await self.error(gid, refused)
        elif msg["type"] == "cancel":
            gen = self.active[key]
            if gen.assignment is None:  # between two replicas: it simply goes nowhere
                del self.active[key]
                await self.send({"type": "cancelled", "id": gen.gid})
                return
            upstream = self._upstreams.get(gen.assignment.worker.replica)
            if upstream is not None:
                try:
                    await upstream.ws.send_message(text)
                except trio_websocket.ConnectionClosed:
                    pass  # its reader reports the generation
        else:
            prompt_kind, body = ws_request(msg)
            model = request_model(body)
            ids = None
            if self.router.policy.uses_kv:
                ids = await self.prompts.token_ids(prompt_kind, body, model)
            gen = _Generation(gid, text, model, ids, request_salt(body))
            self.active[key] = gen
            await self.dispatch(key, gen)

    async def dispatch(self, key: str, gen: _Generation) -> None:
        """Send a generation to the best replica it has not tried; an error to the client if none is left."""
        while True:
            if self.active.get(key) is not gen:
                return  # cancelled while it was between replicas
            a = self.router.choose(gen.model, gen.token_ids, exclude=gen.tried, cache_salt=gen.cache_salt)
            if a is None:
                self.active.pop(key, None)
                self.metrics.unroutable += 1
                await self.error(gen.gid, APIError(503, "no replica can take this request right now", "server_error",
                                                   "no_replica_available"))
                return
            url = a.worker.replica
            gen.tried.append(url)
            gen.assignment = a
            try:
                upstream = await self._upstream(url)
                await upstream.ws.send_message(gen.raw)
                return
            except (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed,
                    trio_websocket.ConnectionTimeout) as exc:
                self.router.release(a)
                gen.assignment = None
                log.warning("replica %s: websocket: %r", url, exc)
                self.router.on_health(url, False, trio.current_time(), f"websocket: {failure_reason(exc)}")
                self.metrics.on_retry("connect")

    async def _upstream(self, url: str) -> _Upstream:
        lock = self._opening.setdefault(url, trio.Lock())
        async with lock:
            upstream = self._upstreams.get(url)
            if upstream is None:
                upstream = await self.nursery.start(self._run_upstream, url)
            return upstream

    async def _run_upstream(self, url: str, *, task_status: trio.TaskStatus[_Upstream]) -> None:
        ws_url = "ws" + url[len("http"):] + "/v1/ws"
        # Its own context (and reader task): closing it on the way out must not depend on the session's tasks.
        # A replica never sends a message over MAX_SEND_BYTES (it fails that generation instead), so no message
        # can close this socket, which the client's other generations on this replica share.
        async with trio_websocket.open_websocket_url(ws_url, extra_headers=self.headers,
                                                     connect_timeout=self.connect_timeout_s,
                                                     disconnect_timeout=1.0, max_message_size=MAX_SEND_BYTES) as conn:
            upstream = _Upstream(url, conn)
            self._upstreams[url] = upstream
            task_status.started(upstream)
            try:
                while True:
                    text = await conn.get_message()
                    await self._from_upstream(url, text if isinstance(text, str) else text.decode())
            except trio_websocket.ConnectionClosed:
                pass
            finally:
                self._upstreams.pop(url, None)
        await self._orphaned(url)

    async def _from_upstream(self, url: str, text: str) -> None:
        try:
            msg, gid = parse_message(text)  # as strictly as the client's messages
        except BadMessage:
            return
        key = str(gid)
        gen = self.active.get(key)
        if gen is None or gen.assignment is None or gen.assignment.worker.replica != url:
            return  # a generation that already moved or ended
        kind = msg.get("type")
        if kind == "error" and not gen.started and (msg.get("error") or {}).get("code") in RETRY_CODES:
            self.router.release(gen.assignment)
            gen.assignment = None
            self.metrics.on_retry("503")
            self.nursery.start_soon(self.dispatch, key, gen)
            return
        if kind == "delta" and not gen.started:
            gen.started = True
            self.router.on_first_token(gen.assignment)
        await self.out.send(text)
        if kind in ("done", "error", "cancelled"):
            self.router.release(gen.assignment, computed=gen.started)  # a delta came: the prompt was computed
            self.active.pop(key, None)

    async def _orphaned(self, url: str) -> None:
        """The upstream socket to `url` died: its generations move if they can, else fail."""
        for key, gen in list(self.active.items()):
            if gen.assignment is None or gen.assignment.worker.replica != url:
                continue
            self.router.release(gen.assignment)
            gen.assignment = None
            if gen.started:
                self.active.pop(key, None)
                await self.error(gen.gid, APIError(502, "the replica failed while streaming this generation",
                                                   "server_error", "replica_failed"))
            else:
                self.metrics.on_retry("dropped")
                await self.dispatch(key, gen)

    def close(self) -> None:
        """The client socket is gone: nothing it started stays counted as in flight."""
        for gen in self.active.values():
            if gen.assignment is not None:
                self.router.release(gen.assignment, computed=gen.started)
        self.active.clear()


async def writer(out: trio.MemoryReceiveChannel[str], send: Any) -> None:
    async with out:
        async for text in out:
            await send(text)
