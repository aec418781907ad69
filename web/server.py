"""Serving: start each model's EngineService, then hypercorn's trio worker; readiness via task_status."""

from __future__ import annotations

import ipaddress
import json
import logging
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from trillm.web.app import create_app
from trillm.web.asgi import ShieldedFinalSend
from trillm.web.config import ServerConfig
from trillm.web.kv_events import KVEventHub, register_kv_events
from trillm.web.service import EngineFactory, EngineService, ServiceConfig

log = logging.getLogger("trillm.web.server")


@dataclass(frozen=True, slots=True)
class Serving:
    """What `serve` reports once it accepts requests."""

    url: str  # e.g. http://127.0.0.1:8000
    services: tuple[EngineService, ...]


def hypercorn_config(config: ServerConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.backlog = config.backlog
    hc.keep_alive_timeout = config.keep_alive_timeout_s
    hc.graceful_timeout = config.graceful_timeout_s
    hc.websocket_max_message_size = config.max_ws_message_bytes
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


def startup_message(url: str, model: str, api_key_set: bool) -> str:
    """Where to send requests, with a copy-paste curl example."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello in one sentence."}]})
    auth = ' -H "Authorization: Bearer $TRILLM_API_KEY"' if api_key_set else ""
    return (f"trillm is serving {model} at {url}/v1 (OpenAI-compatible; websocket {url.replace('http', 'ws', 1)}/v1/ws)\n"
            f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model to serve: the name clients use (None: the model's own) and how to build its engine."""

    name: str | None
    factory: EngineFactory  # runs on the engine thread (threaded), or in the service's task (inline)
    inline: bool = False  # the mock engine: step in a trio task, its simulated time passing on trio's clock


async def serve(models: Sequence[ModelSpec], config: ServerConfig = ServerConfig(),
                *, service_config: ServiceConfig = ServiceConfig(),
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED) -> None:
    """Load every model (each with its own EngineService), then serve until cancelled.

    Reports a `Serving` through `task_status` once requests are accepted. When `shutdown_trigger` returns,
    hypercorn stops accepting, lets open requests finish (within graceful_timeout_s), and then the engines
    stop. `trillm serve --mock` goes through here too: only its ModelSpec differs.
    """
    async with trio.open_nursery() as nursery:
        services: list[EngineService] = []
        for spec in models:
            service: EngineService = await nursery.start(
                EngineService(spec.factory, name=spec.name, config=service_config, inline=spec.inline).run)
            log.info("model %s: %s", service.model_name, service.state.value)
            services.append(service)
        hubs = {s.model_name: KVEventHub(s) for s in services}
        for hub in hubs.values():
            nursery.start_soon(hub.run)
        quart_app = create_app(services, config)
        register_kv_events(quart_app, hubs)
        app = ShieldedFinalSend(quart_app)

        async def http(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(app, hypercorn_config(config), shutdown_trigger=shutdown_trigger,
                                  task_status=task_status, mode="asgi")
            nursery.cancel_scope.cancel()  # HTTP has shut down gracefully: stop the engines

        binds = await nursery.start(http)
        url = binds[0]
        if not _is_loopback(config.host) and config.api_key is None:
            log.warning("listening on %s without --api-key: anyone who can reach it can use it", config.host)
        log.info("%s", startup_message(url, services[0].model_name, config.api_key is not None))
        task_status.started(Serving(url, tuple(services)))
