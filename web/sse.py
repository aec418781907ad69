"""Server-sent events: the OpenAI stream of `data: {json}` chunks, with keepalive comments on a timer."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import trio

from trillm.engine.errors import EngineError
from trillm.web.errors import to_api_error
from trillm.web.protocol import ResponseBuilder
from trillm.web.stream import GenerationFailed, GenerationHandle

log = logging.getLogger("trillm.web.sse")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def sse_stream(handle: GenerationHandle, builder: ResponseBuilder, *,
                     keepalive_s: float) -> AsyncIterator[bytes]:
    """The whole event stream of one generation. Closing it (or cancelling the reader) aborts the generation.

    Keepalive comments go out on a wall-clock timer while no token arrives (queued or prefilling): they keep
    clients from timing out, and a failed write is how hypercorn's trio worker notices a gone client.
    """
    try:
        yield b"".join(sse_event(c) for c in builder.first_chunks()) or KEEPALIVE
        while True:
            received = False
            with trio.move_on_after(keepalive_s):
                try:
                    outputs = await handle.receive_batch()
                except trio.EndOfChannel:
                    break
                received = True
            if not received:
                yield KEEPALIVE
                continue
            data = b"".join(sse_event(c) for out in outputs for c in builder.delta_chunks(out))
            if data:
                yield data
        yield b"".join(sse_event(c) for c in builder.final_chunks()) + DONE
    except (GenerationFailed, EngineError) as exc:  # the engine failed, the client lagged, the server stops
        yield sse_event(to_api_error(exc).body()) + DONE
    except Exception as exc:  # a bug rendering this stream ends it with an error event, never a dropped connection
        log.exception("the event stream failed", exc_info=exc)
        yield sse_event(to_api_error(exc).body()) + DONE
    finally:
        handle.close()
