"""The quart-trio app: OpenAI-compatible HTTP endpoints, /health, /metrics, /tokenize, and the websocket."""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio
from quart import Response, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trillm.web.config import ServerConfig
from trillm.web.errors import APIError, to_api_error
from trillm.web.generation import ModelRegistry, any_tokenizer, start_generation
from trillm.web.metrics import render_kernel_metrics, render_metrics
from trillm.web.playground import register_playground
from trillm.web.protocol import Kind, ResponseBuilder, chat_prompt_ids
from trillm.web.service import EngineService, EngineUnavailable, retry_after_seconds
from trillm.web.sse import sse_stream
from trillm.web.ws import register_websocket, subprotocol_api_key

log = logging.getLogger("trillm.web.app")


def json_response(obj: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status, headers=headers or {},
                    content_type="application/json")


def kernels_json(service: EngineService) -> dict[str, Any] | None:
    """Which implementation each kernel op runs and why (the engine's start-up self-check); None before it ran."""
    report = service.kernel_report
    if report is None:
        return None
    return {"mode": report.mode, "backend": report.backend,
            "ops": {r.op: {"implementation": r.implementation, "reason": r.reason} for r in report.ops}}


def error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status, err.headers)


async def json_body() -> dict[str, Any]:
    body = await request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def _started(gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Start `gen` now, so its `finally` (the abort) runs even if the body is never iterated."""
    first = await gen.__anext__()

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in gen:
            yield chunk

    return body()


def create_app(services: Sequence[EngineService], config: ServerConfig = ServerConfig()) -> QuartTrio:
    """The app for already-running services (their nursery belongs to the caller, see server.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    app = QuartTrio(__name__, root_path=here, instance_path=here)  # namespace package: give paths
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # quart's 60 s default silently cuts long generations
    registry = ModelRegistry(services)
    app.extensions["trillm.registry"] = registry

    def authorized(headers: Any, offered_key: bytes | None = None) -> bool:
        if config.api_key is None:
            return True
        if offered_key is not None and hmac.compare_digest(offered_key, config.api_key.encode()):
            return True
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.api_key.encode())

    def protected(path: str) -> bool:
        return path.startswith(("/v1/", "/internal/")) or path in ("/tokenize", "/detokenize")

    @app.before_request
    async def check_auth() -> Response | None:
        if protected(request.path) and not authorized(request.headers):
            return error_response(APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                           "authentication_error", "invalid_api_key"))
        return None

    @app.before_websocket
    async def check_ws_auth() -> Response | None:
        if not authorized(websocket.headers, subprotocol_api_key(websocket.requested_subprotocols)):
            return error_response(APIError(401, "missing or wrong API key", "authentication_error",
                                           "invalid_api_key"))
        return None

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        return error_response(APIError(code, exc.description or exc.name,
                                       "invalid_request_error" if code < 500 else "server_error", exc.name))

    @app.errorhandler(Exception)
    async def any_error(exc: Exception) -> Response:
        err = to_api_error(exc, retry_after=1)
        if err.status == 500 and err.code == "internal_error":
            log.exception("unhandled error on %s", request.path, exc_info=exc)
        if err.status == 503 and isinstance(exc, EngineUnavailable):
            err = to_api_error(exc, retry_after=max(retry_after_seconds(s) for s in registry.services))
        return error_response(err)

    async def generate(kind: Kind) -> Response:
        body = await json_body()
        service = registry.select(body.get("model"))
        req, handle, tokenizer = await start_generation(service, body, kind, config)
        builder = ResponseBuilder(req, handle.request_ids, tokenizer)
        if req.stream:
            stream = await _started(sse_stream(handle, builder, keepalive_s=config.sse_keepalive_s))
            response = Response(stream, content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            response.timeout = None
            return response
        with handle:
            while True:
                try:
                    builder.add(await handle.receive())
                except trio.EndOfChannel:
                    break
        return json_response(builder.response())

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate("completion")

    @app.get("/v1/models")
    async def models() -> Response:
        data = [{"id": s.model_name, "object": "model", "created": 0, "owned_by": "trillm",
                 "max_model_len": s.max_model_len, "ready": s.healthy} for s in registry.services]
        return json_response({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        states = {s.model_name: {"state": s.state.value, "restarts": s.num_restarts, "kernels": kernels_json(s),
                                 "error": s.last_error} for s in registry.services}
        ok = all(s.healthy for s in registry.services)
        return json_response({"status": "ok" if ok else "unavailable", "models": states}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = render_metrics({s.model_name: (s.metrics, s.statistics().engine, s.healthy)
                               for s in registry.services})
        text += render_kernel_metrics({s.model_name: s.kernel_report.implementations()
                                       for s in registry.services if s.kernel_report is not None})
        return Response(text, content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = await json_body()
        service = registry.select(body.get("model"))
        tokenizer = await any_tokenizer(service)
        if "messages" in body:
            ids = chat_prompt_ids(body, tokenizer)
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages'")
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": service.max_model_len})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        body = await json_body()
        service = registry.select(body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise APIError(400, "'tokens' must be a list of token ids")
        tokenizer = await any_tokenizer(service)
        if any(not 0 <= t < tokenizer.vocab_size for t in tokens):
            raise APIError(400, "token ids must be in [0, vocab_size)")
        return json_response({"prompt": tokenizer.decode(tokens, skip_special_tokens=False)})

    register_websocket(app, registry, config)
    register_playground(app, registry)
    return app
