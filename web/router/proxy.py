"""Forwarding one HTTP request to a replica, its response streamed back byte for byte.

Until the replica has answered with a status line, the request may move: a replica that refuses the
connection (or drops it before answering) or answers 503 (overloaded, or its model is not ready) is left for
the next choice, at most once per replica. Once the response has started, its bytes are the client's; if the
replica dies mid-stream, an SSE stream ends with the same error event a replica sends for a failed
generation, and any other body is cut (the client sees a truncated response, not a clean end).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import httpx
import pydantic_core
import trio
from quart import Response
from werkzeug.datastructures import Headers

from trillm.web.errors import APIError
from trillm.web.router.core import Assignment, Router
from trillm.web.router.metrics import RouterMetrics
from trillm.web.router.prompt import PromptKind
from trillm.web.router.replica import failure_reason
from trillm.web.router.tokenizers import PromptSource

log = logging.getLogger("trillm.web.router")

# Per-connection headers that must not be forwarded (RFC 9110 section 7.6.1), and what httpx sets itself.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
RETRY_STATUS = 503


class UpstreamBroke(Exception):
    """The replica's response broke off after it had started (it cannot be retried)."""


def request_headers(headers: Iterable[tuple[str, str]], replica_api_key: str | None) -> list[tuple[str, str]]:
    out = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP
           and not (replica_api_key is not None and k.lower() in ("authorization", "x-api-key"))]
    if replica_api_key is not None:
        out.append(("Authorization", f"Bearer {replica_api_key}"))
    return out


# The router's own server writes these for its responses.
SERVER_SET = frozenset({"date", "server"})


def response_headers(headers: httpx.Headers) -> Headers:
    return Headers([(k, v) for k, v in headers.multi_items()
                    if (k.lower() not in HOP_BY_HOP or k.lower() == "content-length") and k.lower() not in SERVER_SET])


def sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"


def request_model(body: Any) -> str | None:
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def request_salt(body: Any) -> str | None:
    """The request's cache_salt (the same top-level field on every API); one the replica would refuse (empty,
    not a string) routes unsalted, and the replica answers it with its 400."""
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return salt if isinstance(salt, str) and salt else None


class Forwarder:
    def __init__(self, router: Router, client: httpx.AsyncClient, prompts: PromptSource, metrics: RouterMetrics,
                 *, replica_api_key: str | None = None) -> None:
        self.router = router
        self.client = client
        self.prompts = prompts
        self.metrics = metrics
        self.replica_api_key = replica_api_key

    async def forward(self, method: str, path: str, query: bytes, headers: Iterable[tuple[str, str]],
                      raw: bytes, kind: PromptKind | None) -> Response:
        """Choose a replica (retrying as the module docstring says) and stream its response back."""
        t0 = time.perf_counter()
        body: Any = None
        if raw and (kind is not None or method == "POST"):
            try:
                # The replicas' parser (pydantic's): bounded nesting and no lone surrogates, where the stdlib's
                # raises RecursionError or lets through text that cannot be sent on (a 500 either way).
                body = pydantic_core.from_json(raw)
            except ValueError:
                body = None  # the replica will say what is wrong with it (its 400)
        model, salt = request_model(body), request_salt(body)
        tokenize_s = None
        ids = None
        if kind is not None and self.router.policy.uses_kv:
            t1 = time.perf_counter()
            ids = await self.prompts.token_ids(kind, body, model)
            tokenize_s = time.perf_counter() - t1
        fwd_headers = request_headers(headers, self.replica_api_key)
        target = path + ("?" + query.decode("latin-1") if query else "")
        tried: list[str] = []
        refused: httpx.Response | None = None
        refused_body = b""
        first_attempt = True
        while True:
            a = self.router.choose(model, ids, exclude=tried, cache_salt=salt)
            if a is None:
                break
            replica = a.worker.replica
            tried.append(replica)
            if first_attempt:
                self.metrics.on_decision(time.perf_counter() - t0, tokenize_s)
                first_attempt = False
            # The body goes as it came: cache_salt (and everything else) reaches the replica untouched.
            request = self.client.build_request(method, replica + target, content=raw, headers=fwd_headers)
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TransportError as exc:
                self.router.release(a)
                reason = "connect" if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)) else "dropped"
                if reason == "connect":  # it refuses connections: out of the pool until a health check passes
                    log.warning("replica %s: %s: %r", replica, path, exc)
                    self.router.on_health(replica, False, trio.current_time(), f"connect: {failure_reason(exc)}")
                self.metrics.on_retry(reason)
                self.metrics.on_response(replica, None)
                continue
            except BaseException:
                self.router.release(a)
                raise
            if response.status_code == RETRY_STATUS:
                try:
                    refused_body = await response.aread()
                finally:
                    await response.aclose()
                    self.router.release(a)
                refused = response
                self.metrics.on_retry("503")
                self.metrics.on_response(replica, RETRY_STATUS)
                continue
            # Nothing has gone to the client until the first piece of the body is here: a replica that dies
            # before it (headers sent, body not) still lets the request move.
            chunks = response.aiter_raw()
            try:
                first: bytes | None = await chunks.__anext__()
            except StopAsyncIteration:
                first = None
            except httpx.TransportError:
                await response.aclose()
                self.router.release(a)
                self.metrics.on_retry("dropped")
                self.metrics.on_response(replica, None)
                continue
            except BaseException:
                with trio.CancelScope(shield=True):
                    await response.aclose()
                self.router.release(a)
                raise
            self.metrics.on_response(replica, response.status_code)
            return await self._relay(response, first, chunks, a)
        if refused is not None:  # every replica that answered was full: the client sees the last 503
            return Response(refused_body, RETRY_STATUS, response_headers(refused.headers))
        self.metrics.unroutable += 1
        raise APIError(503, "no replica can take this request right now", "server_error", "no_replica_available",
                       headers={"Retry-After": "1"})

    async def _relay(self, response: httpx.Response, first: bytes | None, chunks: AsyncIterator[bytes],
                     a: Assignment) -> Response:
        """The response, its body streamed from `first` on; releases `a` and closes `response` when done."""
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        router = self.router
        computed = False  # the replica answered it in full: its prompt is cached there now

        async def body() -> AsyncGenerator[bytes, None]:
            nonlocal computed
            try:
                if first is None:
                    computed = response.status_code < 400
                    return
                if not is_sse:
                    router.on_first_token(a)  # any other body is complete when it comes
                yield first
                # A trillm replica's stream opens with a chunk at once (the role, or a keepalive): the next
                # one carries tokens, so the prompt has been computed.
                try:
                    async for chunk in chunks:
                        router.on_first_token(a)
                        yield chunk
                    computed = response.status_code < 400
                except httpx.TransportError as exc:
                    log.warning("%s broke off a response: %s", a.worker.replica, exc)
                    self.metrics.on_response(a.worker.replica, None)
                    if not is_sse:
                        raise UpstreamBroke(str(exc)) from exc
                    yield sse_error("the replica failed while streaming this response")
            finally:
                router.release(a, computed=computed)
                with trio.CancelScope(shield=True):
                    await response.aclose()

        gen = body()
        # Start it now, so that its `finally` (release, close) runs even if the body is never iterated.
        try:
            head = await gen.__anext__()
        except StopAsyncIteration:
            head = b""

        async def stream() -> AsyncIterator[bytes]:
            try:
                if head:
                    yield head
                async for chunk in gen:
                    yield chunk
            finally:
                await gen.aclose()

        out = Response(stream(), status=response.status_code, headers=response_headers(response.headers))
        out.timeout = None
        return out
