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
from trillm.engine.mock.events import EngineObserver
from trillm.web.kv_events import KVEventHub, register_kv_events
from trillm.web.service import Engine, EngineService, ServiceConfig

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


def _observed(factory: Callable[[], Engine], hub: KVEventHub) -> Callable[[], Engine]:
    """Each engine the factory builds (restarts too) publishes its KV events and load to the hub."""

    def build() -> Engine:
        engine = factory()
        if not hasattr(engine, "block_manager"):  # not an LLMEngine (a test double): nothing to observe
            return engine
        observer = EngineObserver(engine)  # type: ignore[arg-type]
        hub.observer = observer
        return observer  # type: ignore[return-value]

    return build


async def serve(engines: Sequence[tuple[str | None, Callable[[], Engine]]], config: ServerConfig = ServerConfig(),
                *, service_config: ServiceConfig = ServiceConfig(),
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED) -> None:
    """Load every model (each on its own engine thread), then serve until cancelled.

    `engines` pairs a served name (None: the model's own) with a factory that builds the engine; the
    factory runs on the engine thread. Reports a `Serving` through `task_status` once requests are accepted.
    When `shutdown_trigger` returns, hypercorn stops accepting, lets open requests finish (within
    graceful_timeout_s), and then the engines stop.
    """
    async with trio.open_nursery() as nursery:
        services = []
        hubs: dict[str, KVEventHub] = {}
        for name, factory in engines:
            hub = KVEventHub(name or "")
            service: EngineService = await nursery.start(
                EngineService(_observed(factory, hub), name=name, config=service_config).run)
            log.info("model %s: %s", service.model_name, service.state.value)
            services.append(service)
            hub.model = service.model_name
            hubs[service.model_name] = hub
            nursery.start_soon(hub.run)
        quart_app = create_app(services, config)
        register_kv_events(quart_app, hubs)
        app = ShieldedFinalSend(quart_app)

        async def http(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(app, hypercorn_config(config), shutdown_trigger=shutdown_trigger,
                                  task_status=task_status, mode="asgi")
            nursery.cancel_scope.cancel()  # HTTP has shut down gracefully: stop the engine threads

        binds = await nursery.start(http)
        url = binds[0]
        if not _is_loopback(config.host) and config.api_key is None:
            log.warning("listening on %s without --api-key: anyone who can reach it can use it", config.host)
        log.info("%s", startup_message(url, services[0].model_name, config.api_key is not None))
        task_status.started(Serving(url, tuple(services)))
