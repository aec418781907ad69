"""The router's quart-trio app and `route()`, which runs it on hypercorn with a monitor per replica.

Routes: every POST (and GET) under /v1/ is forwarded to one replica (chat, completions, Anthropic's
Messages and OpenAI's Responses are routed by their prompt; anything else by load), as are POST /tokenize
and /detokenize; /v1/ws is
proxied per generation (ws.py). The router answers GET /v1/models (every replica's models), /health (200
while any replica is in the pool), /metrics and /stats (its own view: replicas, workers, indexes, decision
times) itself.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request, websocket
from quart_trio import QuartTrio

from trillm.web.anthropic.translate import MESSAGES_PATH, anthropic_error
from trillm.web.errors import to_api_error
from trillm.web.http.asgi import ShieldedFinalSend
from trillm.web.http.body import json_response
from trillm.web.http.guards import (
    ORIGIN_REFUSED, WRONG_KEY, error_response, install_guards, is_authorized, register_error_shape,
    same_or_allowed_origin,
)
from trillm.web.http.keys import offered_key, subprotocol_api_key
from trillm.web.router.config import RouterConfig
from trillm.web.router.core import Router
from trillm.web.router.metrics import RouterMetrics, statistics_json
from trillm.web.router.policy import Policy
from trillm.web.router.prompt import prompt_kind
from trillm.web.router.proxy import Forwarder
from trillm.web.router.replica import ReplicaMonitor
from trillm.web.router.tokenizers import PromptSource
from trillm.web.router.ws import WSSession, writer
from trillm.web.server import hypercorn_config
from trillm.web.ws.session import SUBPROTOCOL

log = logging.getLogger("trillm.web.router")


@dataclass(frozen=True, slots=True)
class Routing:
    """What `route` reports once it accepts requests."""

    url: str
    router: Router
    metrics: RouterMetrics
    monitors: tuple[ReplicaMonitor, ...]


def create_router_app(config: RouterConfig, router: Router, forwarder: Forwarder, prompts: PromptSource,
                      metrics: RouterMetrics, monitors: dict[str, ReplicaMonitor]) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as their generation
    api_key = config.server.api_key

    install_guards(app, api_key, config.server.allowed_origins, config.server.host)
    register_error_shape(app, MESSAGES_PATH, anthropic_error)  # as a replica answers

    @app.errorhandler(Exception)
    async def any_error(exc: Exception) -> Response:
        err = to_api_error(exc)
        if err.status == 500:
            log.exception("unhandled error on %s", request.path, exc_info=exc)
        return error_response(err, request.path)  # in the shape of the API at that path, as a replica does

    async def forward(path: str) -> Response:
        raw = await request.get_data(cache=False)
        assert isinstance(raw, bytes)
        return await forwarder.forward(request.method, path, request.query_string, request.headers.items(), raw,
                                       prompt_kind(path) if request.method == "POST" else None)

    @app.route("/v1/<path:rest>", methods=["POST", "GET"])
    async def v1(rest: str) -> Response:
        return await forward("/v1/" + rest)

    @app.post("/tokenize")
    @app.post("/detokenize")
    async def tokenizer() -> Response:
        return await forward(request.path)

    @app.get("/v1/models")
    async def models() -> Response:
        seen: dict[str, dict[str, Any]] = {}
        for url, monitor in monitors.items():
            in_pool = router.in_pool(url)
            for entry in monitor.model_entries:
                m = seen.setdefault(entry["id"], {**entry, "ready": False, "replicas": 0})
                m["replicas"] += 1
                m["ready"] = bool(m["ready"] or (in_pool and entry.get("ready", True)))
        return json_response({"object": "list", "data": list(seen.values())})

    @app.get("/health")
    async def health() -> Response:
        stats = router.statistics()
        replicas = {r.url: {"health": r.health.state.value, "reason": r.health.reason, "models": list(r.models)}
                    for r in stats.replicas}
        ok = any(router.in_pool(r.url) for r in stats.replicas)
        return json_response({"status": "ok" if ok else "unavailable", "policy": stats.policy,
                              "replicas": replicas}, 200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(router.statistics()), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {**statistics_json(router.statistics()), "overhead": metrics.overhead_json(),
                "retries": dict(metrics.retries), "unroutable_responses": metrics.unroutable,
                "tokenizer": prompts.mode, "tokenizers": prompts.statistics()}

    @app.post("/stats/reset")
    async def reset_stats() -> Response | dict[str, Any]:
        # It changes what /stats reports: the API key when one is set, and never from another site's page (a
        # form POST from any page needs no CORS preflight).
        if not same_or_allowed_origin(request.headers, config.server.allowed_origins, config.server.host):
            return error_response(ORIGIN_REFUSED)
        if not is_authorized(api_key, request.headers):
            return error_response(WRONG_KEY)
        metrics.reset_window()
        return {"reset": True}

    @app.websocket("/v1/ws")
    async def ws() -> None:
        await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in websocket.requested_subprotocols else None)
        # The replicas' key, or the one the client offered (a header or a subprotocol), as a Bearer token.
        key = config.replica_api_key or offered_key(websocket.headers,
                                                    subprotocol_api_key(websocket.requested_subprotocols))
        key = key.encode() if isinstance(key, str) else key
        headers = [] if key is None else [(b"Authorization", b"Bearer " + key)]
        send, recv = trio.open_memory_channel[str](256)
        session: WSSession | None = None
        try:
            async with trio.open_nursery() as nursery, send:
                nursery.start_soon(writer, recv, websocket.send)
                session = WSSession(nursery, send, router, prompts, metrics, headers=headers,
                                    max_generations=config.server.max_ws_generations,
                                    connect_timeout_s=config.connect_timeout_s)
                while True:  # ends when quart-trio cancels us on disconnect
                    await session.on_message(await websocket.receive())
        finally:
            if session is not None:
                session.close()

    return app


async def route(config: RouterConfig, *, shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                task_status: trio.TaskStatus[Routing] = trio.TASK_STATUS_IGNORED) -> None:
    """Monitor every replica and serve the router until cancelled (or `shutdown_trigger` returns).

    Reports a `Routing` once requests are accepted: after each replica's first health check (or its
    timeout), so a router started in front of running replicas routes its first request.
    """
    router = Router(config.replicas, Policy(config.policy, config.weights), rejoin_after=config.rejoin_after)
    metrics = RouterMetrics()
    replica_headers = {} if config.replica_api_key is None else {"Authorization": f"Bearer {config.replica_api_key}"}
    timeout = httpx.Timeout(None, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=4096)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        prompts = PromptSource(router, client, config.tokenizer, headers=replica_headers)
        monitors = {url: ReplicaMonitor(url, router, client, prompts, headers=replica_headers,
                                        interval_s=config.health_interval_s, timeout_s=config.health_timeout_s,
                                        max_backoff_s=config.resubscribe_max_backoff_s)
                    for url in config.replicas}
        forwarder = Forwarder(router, client, prompts, metrics, replica_api_key=config.replica_api_key)
        async with trio.open_nursery() as nursery:
            for monitor in monitors.values():
                nursery.start_soon(monitor.run)
            with trio.move_on_after(config.health_timeout_s + 0.5):
                for monitor in monitors.values():
                    await monitor.wait_checked()
            app = ShieldedFinalSend(create_router_app(config, router, forwarder, prompts, metrics, monitors))

            async def http(task_status: trio.TaskStatus[list[str]]) -> None:
                await hypercorn_serve(app, hypercorn_config(config.server), shutdown_trigger=shutdown_trigger,
                                      task_status=task_status, mode="asgi")
                nursery.cancel_scope.cancel()  # HTTP has shut down gracefully: stop the monitors

            binds = await nursery.start(http)
            url = binds[0]
            in_pool = sum(router.in_pool(u) for u in config.replicas)
            log.info("trillm route (%s policy) at %s over %d replicas (%d in the pool)", config.policy.value, url,
                     len(config.replicas), in_pool)
            task_status.started(Routing(url, router, metrics, tuple(monitors.values())))
