"""Server-sent events: one generation's deltas as an event stream, with keepalives on a timer.

The waiting lives here; what the bytes say is a `StreamTranslator`'s (sans-IO) business: OpenAI's
`data: {json}` chunks ending in `data: [DONE]`, or named events (`event: NAME` lines) for the Messages and
Responses APIs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import trio

from trillm.engine.errors import EngineError
from trillm.engine.outputs import RequestOutput
from trillm.web.service.stream import GenerationFailed, GenerationHandle

log = logging.getLogger("trillm.web.http.sse")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_named_event(name: str, obj: dict[str, Any]) -> bytes:
    """An event with an `event:` line, as Anthropic's and OpenAI's Responses streams name each one."""
    return b"event: " + name.encode() + b"\n" + sse_event(obj)


class StreamTranslator(Protocol):
    """Turns one generation's deltas into the bytes of its event stream; no IO."""

    @property
    def keepalive(self) -> bytes: ...

    def opening(self) -> bytes: ...

    def outputs(self, outputs: list[RequestOutput]) -> bytes: ...

    def closing(self) -> bytes: ...

    def failure(self, exc: Exception) -> bytes: ...


async def event_stream(handle: GenerationHandle, translator: StreamTranslator, *,
                       keepalive_s: float) -> AsyncIterator[bytes]:
    """The whole event stream of one generation. Closing it (or cancelling the reader) aborts the generation.

    Keepalives go out on a wall-clock timer while no token arrives (queued or prefilling): they keep
    clients from timing out, and a failed write is how hypercorn's trio worker notices a gone client.
    """
    try:
        yield translator.opening() or translator.keepalive
        while True:
            with trio.move_on_after(keepalive_s) as waited:
                try:
                    outputs = await handle.receive_batch()
                except trio.EndOfChannel:
                    break
            if waited.cancelled_caught:
                yield translator.keepalive
                continue
            data = translator.outputs(outputs)
            if data:
                yield data
        yield translator.closing()
    except (GenerationFailed, EngineError) as exc:  # the engine failed, the client lagged, the server stops
        yield translator.failure(exc)
    except Exception as exc:  # a bug rendering this stream ends it with an error event, never a dropped connection
        log.exception("the event stream failed", exc_info=exc)
        yield translator.failure(exc)
    finally:
        handle.close()
