"""The quart-trio app: OpenAI-compatible HTTP endpoints, Anthropic's Messages and OpenAI's Responses APIs
(agent_routes.py), /health, /metrics, /tokenize (and /detokenize, /tokenizer_info), and the websocket."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from urllib.parse import urlsplit
from collections.abc import Sequence
from typing import Any

import trio
from quart import Response, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trillm.web.agent_routes import AGENT_ROUTES, anthropic_path, register_agent_apis
from trillm.web.anthropic_api import anthropic_error
from trillm.web.config import ServerConfig
from trillm.web.errors import APIError, to_api_error
from trillm.web.http import event_stream_response, json_body, json_response, large_body, started
from trillm.web.generation import ModelRegistry, any_tokenizer, off_thread, start_generation
from trillm.web.keys import KeyRing, install_key_limits, offered_key
from trillm.web.metrics import render_key_metrics, render_kernel_metrics, render_metrics
from trillm.web.playground import register_playground
from trillm.web.openai_schema import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, OPENAI_ROUTES, openapi_document,
)
from trillm.web.protocol import Kind, ResponseBuilder, chat_prompt_ids
from trillm.web.service import EngineService
from trillm.web.sse import sse_stream
from trillm.web.ws import register_websocket, subprotocol_api_key

log = logging.getLogger("trillm.web.app")


def kernels_json(service: EngineService) -> dict[str, Any] | None:
    """Which implementation each kernel op runs and why (the engine's start-up self-check); None before it ran."""
    report = service.kernel_report
    if report is None:
        return None
    return {"mode": report.mode, "backend": report.backend,
            "ops": {r.op: {"implementation": r.implementation, "reason": r.reason} for r in report.ops}}


def error_response(err: APIError, path: str = "") -> Response:
    """The error in the shape of the API at `path`: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    if anthropic_path(path):
        status, body = anthropic_error(err)
        return json_response(body, status, err.headers)
    return json_response(err.body(), err.status, err.headers)


def is_authorized(api_key: str | None, headers: Any, offered_key: bytes | None = None) -> bool:
    """No key configured, or the right one: a Bearer token, x-api-key, or offered as a websocket subprotocol."""
    if api_key is None:
        return True
    if offered_key is not None and hmac.compare_digest(offered_key, api_key.encode()):
        return True
    x_api_key = headers.get("x-api-key")  # Anthropic's clients send the key here
    if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), api_key.encode()):
        return True
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def is_protected(path: str) -> bool:
    """What needs the API key: the API, internal feeds and the tokenizer endpoints (not /, /health, /metrics)."""
    return path.startswith(("/v1/", "/internal/")) or path in ("/tokenize", "/detokenize", "/tokenizer_info")


def _loopback_host(host: str) -> bool:
    """localhost, *.localhost (browsers resolve both to loopback, never through DNS) or a loopback address."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _default_port(scheme: str) -> int:
    return 443 if scheme in ("https", "wss") else 80


def same_or_allowed_origin(headers: Any, allowed_origins: Sequence[str], bind_host: str = "127.0.0.1") -> bool:
    """A web page on any site can open a websocket to 127.0.0.1 (browsers send no CORS preflight for them),
    so a browser's Origin must be one of this server's own pages, or one the operator allowed.

    The Host header cannot say which pages are this server's own: under DNS rebinding an attacker's name
    (evil.test) resolves to this server, and the browser sends `Host: evil.test:8000` with
    `Origin: http://evil.test:8000`. So an Origin is this server's own only when its host is one no DNS answer
    can make up: a loopback name or address while the server listens on loopback (a wildcard bind does too),
    or an IP address the server listens on. Its port must be the port the request came to. Anything else
    needs --allowed-origin."""
    origin: str | None = headers.get("Origin")
    if origin is None:
        return True  # not a browser
    if origin.rstrip("/") in allowed_origins or origin in allowed_origins:
        return True
    try:
        page = urlsplit(origin)
        here = urlsplit("//" + headers.get("Host", ""))
        page_port = page.port or _default_port(page.scheme)
        here_port = here.port or _default_port(page.scheme)
    except ValueError:  # a malformed port
        return False
    if page.scheme not in ("http", "https") or not page.hostname or page_port != here_port:
        return False
    address, bound = _ip_literal(page.hostname), _ip_literal(bind_host)
    wildcard = bound is not None and bound.is_unspecified  # 0.0.0.0 or ::, loopback included
    if (_loopback_host(bind_host) or wildcard) and _loopback_host(page.hostname):
        return True
    if address is None or bound is None:
        return False
    # The page came from one of our addresses: the one bound, or (a wildcard bind) the one this request came to.
    return address == bound or (wildcard and page.hostname.lower() == (here.hostname or "").lower())


def install_guards(app: QuartTrio, api_key: str | None, allowed_origins: Sequence[str],
                   bind_host: str = "127.0.0.1", internal_api_key: str | None = None,
                   key_ring: KeyRing | None = None) -> None:
    """The checks every trillm front makes (a server and the router alike): the API key on protected paths,
    a browser's Origin on the websockets and /internal/*, and HTTP errors in the shape of the API at that path.
    `bind_host`: the address the server listens on (what an Origin is judged against). `internal_api_key`:
    when set, the only key /internal/* takes (the rest of the API takes it too). `key_ring`: the named keys of
    --api-key-file, taken beside `api_key`."""

    def authorized(path: str, headers: Any, offered: bytes | None = None) -> bool:
        if internal_api_key is not None and is_authorized(internal_api_key, headers, offered):
            return True
        if internal_api_key is not None and path.startswith("/internal/"):
            return False
        if not is_protected(path):
            return True
        if key_ring is not None:  # then a key is needed even without --api-key
            return (key_ring.identify(offered_key(headers, offered)) is not None
                    or (api_key is not None and is_authorized(api_key, headers, offered)))
        return is_authorized(api_key, headers, offered)

    def origin_refused() -> Response:
        return error_response(APIError(403, "cross-origin request refused: this page's origin may not use this "
                                            "server (see --allowed-origin)", "permission_error",
                                       "origin_not_allowed"))

    @app.before_request
    async def check_auth() -> Response | None:
        if request.path.startswith("/internal/") and not same_or_allowed_origin(
                request.headers, allowed_origins, bind_host):
            return origin_refused()
        if not authorized(request.path, request.headers):
            return error_response(APIError(401, "missing or wrong API key (Authorization: Bearer ... or x-api-key)",
                                           "authentication_error", "invalid_api_key"), request.path)
        return None

    @app.before_websocket
    async def check_ws_auth() -> Response | None:
        if not same_or_allowed_origin(websocket.headers, allowed_origins, bind_host):
            return origin_refused()
        if not authorized(websocket.path, websocket.headers, subprotocol_api_key(websocket.requested_subprotocols)):
            return error_response(APIError(401, "missing or wrong API key", "authentication_error",
                                           "invalid_api_key"))
        return None

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        return error_response(APIError(code, exc.description or exc.name,
                                       "invalid_request_error" if code < 500 else "server_error", exc.name),
                              request.path)


def create_app(services: Sequence[EngineService], config: ServerConfig = ServerConfig()) -> QuartTrio:
    """The app for already-running services (their nursery belongs to the caller, see server.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    app = QuartTrio(__name__, root_path=here, instance_path=here)  # namespace package: give paths
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # quart's 60 s default silently cuts long generations
    registry = ModelRegistry(services, config.model_aliases)
    app.extensions["trillm.registry"] = registry

    key_ring = KeyRing(config.api_keys) if config.api_keys else None
    install_guards(app, config.api_key, config.allowed_origins, config.host, config.internal_api_key, key_ring)
    if key_ring is not None:
        install_key_limits(app, key_ring, is_protected, error_response)

    @app.errorhandler(Exception)
    async def any_error(exc: Exception) -> Response:
        err = to_api_error(exc, retry_after=1)
        if err.status == 500 and err.code == "internal_error":
            log.exception("unhandled error on %s", request.path, exc_info=exc)
        return error_response(err, request.path)

    async def generate(kind: Kind) -> Response:
        body: ChatCompletionRequest | CompletionRequest = (
            await json_body(ChatCompletionRequest) if kind == "chat" else await json_body(CompletionRequest))
        service = registry.select(body.model)
        req, handle, tokenizer = await start_generation(service, body, config, large=await large_body())
        builder = ResponseBuilder(req, handle.request_ids, tokenizer)
        if req.stream:
            return event_stream_response(await started(sse_stream(handle, builder, keepalive_s=config.sse_keepalive_s)))
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
        # OpenAI's list, with the fields Anthropic's clients read (type, display_name, created_at, has_more).
        data = [{"id": s.model_name, "object": "model", "created": 0, "owned_by": "trillm",
                 "type": "model", "display_name": s.model_name, "created_at": "1970-01-01T00:00:00Z",
                 "max_model_len": s.max_model_len, "ready": s.healthy} for s in registry.services]
        return json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": data[0]["id"], "last_id": data[-1]["id"]})

    @app.get("/health")
    async def health() -> Response:
        # The failure's own text is for the log, not for whoever can reach /health.
        states = {s.model_name: {"state": s.state.value, "restarts": s.num_restarts, "kernels": kernels_json(s),
                                 "model_check": s.model_check.as_dict() if s.model_check else None,
                                 "next_load_in_s": s.next_load_in_s, "error": s.problem}
                  for s in registry.services}
        ok = all(s.healthy for s in registry.services)
        return json_response({"status": "ok" if ok else "unavailable", "models": states}, 200 if ok else 503)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return json_response(openapi_document(OPENAI_ROUTES + AGENT_ROUTES))

    @app.get("/metrics")
    async def metrics() -> Response:
        text = render_metrics({s.model_name: (s.metrics, s.statistics().engine, s.healthy)
                               for s in registry.services})
        text += render_kernel_metrics({s.model_name: s.kernel_report.implementations()
                                       for s in registry.services if s.kernel_report is not None})
        if key_ring is not None:
            text += render_key_metrics(key_ring.statistics())
        return Response(text, content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = await json_body(TokenizeRequest)
        service = registry.select(body.model)
        tokenizer = await any_tokenizer(service)
        if body.messages is not None:
            messages = body.messages
            ids = await off_thread(lambda: chat_prompt_ids(messages, tokenizer,
                                                           template_kwargs=body.chat_template_kwargs))
        elif body.prompt is not None:
            prompt = body.prompt
            ids = await off_thread(lambda: tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens))
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages'")
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": service.max_model_len})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        # What a client that tokenizes through /tokenize and /detokenize needs (lm-eval's remote tokenizer).
        service = registry.select(request.args.get("model"))
        tokenizer = await any_tokenizer(service)
        special = tokenizer.special_tokens
        return json_response({"eos_token": special.eos_token, "bos_token": special.bos_token,
                              "pad_token": special.pad_token, "chat_template": special.chat_template,
                              "model_max_length": service.max_model_len, "vocab_size": tokenizer.vocab_size})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        body = await json_body(DetokenizeRequest)
        service = registry.select(body.model)
        tokenizer = await any_tokenizer(service)
        if any(t >= tokenizer.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})")
        tokens = body.tokens
        return json_response({"prompt": await off_thread(lambda: tokenizer.decode(tokens, skip_special_tokens=False))})

    register_agent_apis(app, registry, config)
    register_websocket(app, registry, config)
    register_playground(app, registry)
    return app
