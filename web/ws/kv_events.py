"""/internal/kv-events: a websocket that streams each engine's per-step load and KV events, for a router.

`KVEventHub` runs one trio task that drains its service's step reports every `interval_s` and fans them
out to each subscriber's bounded memory channel. A subscriber that falls behind is dropped with a final
message and must reconnect and resync (a gap in event ids says the same; so does a new `epoch`: the engine
was rebuilt and its event ids restarted). Messages are JSON:
  {"type": "hello", "model": NAME, "interval_s": s, "epoch": n, "model_id": ID, "block_size": B,
   "hash_seed": HEX, "prefix_caching": bool}   (the last four are null until the engine first loads)
  {"type": "steps", "model": NAME, "epoch": n, "reports": [{"load": {...}, "kv_events": [...]}, ...]}

A block hash names a prompt prefix: whoever has the seed can hash a guessed prompt and watch for it. So
unless the server reveals them (`ServerConfig.reveals_block_hashes`: an internal key holds /internal/*, or
the server has no key at all), the hello's hash_seed is null and every hash in the events is keyed with a
secret of this process: the events still show load and how many blocks come and go, but match no guess.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import asdict, replace
from typing import Any

import trio
from quart import websocket
from quart_trio import QuartTrio

from trillm.engine.kv_events import KVEvent, StepReport
from trillm.web.service.engine_service import EngineService


class KVEventHub:
    def __init__(self, service: EngineService, *, interval_s: float = 0.05, buffer: int = 256,
                 reveal_hashes: bool = True) -> None:
        self.service = service
        self.reveal_hashes = reveal_hashes
        self._key = secrets.token_bytes(32)  # hides the hashes when they are not revealed
        self.interval_s = interval_s
        self._buffer = buffer
        self._subscribers: set[trio.MemorySendChannel[str]] = set()

    async def run(self) -> None:
        """Drain and fan out until cancelled (reports are dropped while nobody listens). A new epoch is news
        even without reports: subscribers must drop what they know of the old engine's cache now."""
        epoch = self.service.statistics().epoch
        while True:
            await trio.sleep(self.interval_s)
            reports = self.service.drain_reports()
            new_epoch = self.service.statistics().epoch
            if (reports or new_epoch != epoch) and self._subscribers:
                self.publish(reports)
            epoch = new_epoch

    def publish(self, reports: list[StepReport]) -> None:
        msg = json.dumps({"type": "steps", "model": self.service.model_name,
                          "epoch": self.service.statistics().epoch,
                          "reports": [self._shown(r).to_json() for r in reports]})
        for send in list(self._subscribers):
            try:
                send.send_nowait(msg)
            except trio.WouldBlock:
                self._subscribers.discard(send)
                send.close()  # the handler tells the client it fell behind

    def _hide(self, block_hash: str) -> str:
        return hashlib.blake2b(bytes.fromhex(block_hash), key=self._key, digest_size=16).hexdigest()

    def _shown(self, report: StepReport) -> StepReport:
        """The report as subscribers see it: its hashes keyed with this process's secret unless revealed (the
        same block keeps the same name, so the stream stays consistent)."""
        if self.reveal_hashes or not report.kv_events:
            return report
        return replace(report, kv_events=tuple(KVEvent(e.event_id, e.kind, self._hide(e.block_hash),
                                                       None if e.parent_hash is None else self._hide(e.parent_hash),
                                                       e.medium)
                                               for e in report.kv_events))

    def hello(self) -> dict[str, Any]:
        """What a subscriber needs first: the epoch, and how this engine hashes prompt blocks."""
        spec = self.service.kv_cache_spec
        facts = asdict(spec) if spec is not None else {"model_id": None, "block_size": None, "hash_seed": None,
                                                        "prefix_caching": None}
        if not self.reveal_hashes:
            facts = {**facts, "hash_seed": None}
        return {"type": "hello", "model": self.service.model_name, "interval_s": self.interval_s,
                "epoch": self.service.statistics().epoch, **facts}

    def subscribe(self) -> trio.MemoryReceiveChannel[str]:
        send, recv = trio.open_memory_channel[str](self._buffer)
        self._subscribers.add(send)
        return recv

    def unsubscribe(self, recv: trio.MemoryReceiveChannel[str]) -> None:
        recv.close()
        self._subscribers = {s for s in self._subscribers if s.statistics().open_receive_channels}


def register_kv_events(app: QuartTrio, hubs: dict[str, KVEventHub], path: str = "/internal/kv-events") -> None:
    """Add the websocket route; ?model=NAME picks one engine (default: the first)."""

    @app.websocket(path)
    async def kv_events() -> None:
        name = websocket.args.get("model") or next(iter(hubs))
        hub = hubs.get(name)
        if hub is None:
            await websocket.send(json.dumps({"type": "error", "message": f"unknown model {name!r}"}))
            return
        recv = hub.subscribe()
        try:
            async with trio.open_nursery() as nursery:
                # Whatever a client sends is read and dropped: unread frames would fill the socket's bounded
                # queue and hide its close, leaving the handler (and its subscription) behind.
                nursery.start_soon(_discard_incoming)
                await websocket.send(json.dumps({**hub.hello(), "model": name}))
                async for msg in recv:
                    await websocket.send(msg)
                await websocket.send(json.dumps({"type": "dropped", "message": "fell behind; reconnect and resync"}))
                nursery.cancel_scope.cancel()
        finally:
            hub.unsubscribe(recv)


async def _discard_incoming() -> None:
    while True:
        await websocket.receive()
