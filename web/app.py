"""The quart-trio app: every API surface registers its own routes (and error shape); here are the guards,
the error handler, /health, /metrics and /openapi.json."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from trillm.web.anthropic.routes import MESSAGES_ROUTES, register_anthropic
from trillm.web.config import ServerConfig
from trillm.web.errors import to_api_error
from trillm.web.http.body import json_response
from trillm.web.http.guards import error_response, install_guards, is_protected
from trillm.web.http.keys import KeyRing, install_key_limits
from trillm.web.openai.routes import register_openai
from trillm.web.openai.schema import OPENAI_ROUTES, openapi_document
from trillm.web.playground import register_playground
from trillm.web.responses.routes import RESPONSES_ROUTES, register_responses
from trillm.web.service.engine_service import EngineService
from trillm.web.service.metrics import render_kernel_metrics, render_key_metrics, render_metrics
from trillm.web.service.registry import ModelRegistry
from trillm.web.ws.session import register_websocket

log = logging.getLogger("trillm.web.app")


def kernels_json(service: EngineService) -> dict[str, Any] | None:
    """Which implementation each kernel op runs and why (the engine's start-up self-check); None before it ran."""
    report = service.kernel_report
    if report is None:
        return None
    return {"mode": report.mode, "backend": report.backend,
            "ops": {r.op: {"implementation": r.implementation, "reason": r.reason} for r in report.ops}}


def create_app(services: Sequence[EngineService], config: ServerConfig = ServerConfig()) -> QuartTrio:
    """The app for already-running services (their nursery belongs to the caller, see server.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    app = QuartTrio(__name__, root_path=here, instance_path=here)  # namespace package: give paths
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # quart's 60 s default silently cuts long generations
    registry = ModelRegistry(services, config.model_aliases)
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

    for register in (register_openai, register_anthropic, register_responses, register_websocket):
        register(app, registry, config)
    register_playground(app, registry)
    register_ops(app, registry, key_ring)
    return app


def register_ops(app: QuartTrio, registry: ModelRegistry, key_ring: KeyRing | None) -> None:
    """What operators read: /health, /metrics, and the request bodies' schemas at /openapi.json."""

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
        return json_response(openapi_document(OPENAI_ROUTES + MESSAGES_ROUTES + RESPONSES_ROUTES))

    @app.get("/metrics")
    async def metrics() -> Response:
        text = render_metrics({s.model_name: (s.metrics, s.statistics().engine, s.healthy)
                               for s in registry.services})
        text += render_kernel_metrics({s.model_name: s.kernel_report.implementations()
                                       for s in registry.services if s.kernel_report is not None})
        if key_ring is not None:
            text += render_key_metrics(key_ring.statistics())
        return Response(text, content_type="text/plain; version=0.0.4; charset=utf-8")
