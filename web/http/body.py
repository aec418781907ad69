"""What every HTTP route shares: JSON bodies in (validated by a declared model), JSON out, streamed bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import trio

from pydantic import BaseModel
from quart import Response, request

from trillm.web.errors import APIError, parse_body

M = TypeVar("M", bound=BaseModel)


def json_response(obj: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status, headers=headers or {},
                    content_type="application/json")


# Bodies this large are parsed (and translated, templated, tokenized) on a worker thread, so the event loop
# keeps serving other streams.
OFF_LOOP_BODY_BYTES = 16 << 10

T = TypeVar("T")


async def json_body(model: type[M]) -> M:
    """The request body validated against `model`. Only application/json is read: a browser can send a
    text/plain POST to any site without asking first (blind CSRF), never an application/json one."""
    if request.mimetype != "application/json":
        raise APIError(415, "the request body must be JSON (Content-Type: application/json)",
                       code="unsupported_media_type")
    data = await request.get_data()
    return await body_work(lambda: parse_body(model, data))


async def large_body() -> bool:
    """Whether this request's body is large enough that work on it belongs off the event loop."""
    return len(await request.get_data()) > OFF_LOOP_BODY_BYTES


async def body_work(fn: Callable[[], T]) -> T:
    """Work proportional to the request body (parsing, translating): on a worker thread when it is large."""
    return await trio.to_thread.run_sync(fn) if await large_body() else fn()


async def started(gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Start `gen` now, so its `finally` (the abort) runs even if the body is never iterated."""
    first = await gen.__anext__()

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in gen:
            yield chunk

    return body()


def event_stream_response(stream: AsyncIterator[bytes]) -> Response:
    response = Response(stream, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.timeout = None
    return response
