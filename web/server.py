"""Serving: start each model's EngineService, then hypercorn's trio worker; readiness via task_status."""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio
from hypercorn.config import Config as HypercornConfig, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from trillm.web.app import create_app
from trillm.web.config import ServeError, ServerConfig
from trillm.web.http.asgi import ShieldedFinalSend
from trillm.web.http.guards import is_loopback_host
from trillm.web.service.engine_service import EngineFactory, EngineService, ServiceConfig
from trillm.web.ws.kv_events import KVEventHub, register_kv_events

log = logging.getLogger("trillm.web.server")


@dataclass(frozen=True, slots=True)
class Serving:
    """What `serve` reports once it accepts requests."""

    url: str  # e.g. http://127.0.0.1:8000
    services: tuple[EngineService, ...]


# After the drain, hypercorn gives open connections this much longer to flush their last bytes.
FLUSH_MARGIN_S = 2.0


def hypercorn_config(config: ServerConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.backlog = config.backlog
    hc.keep_alive_timeout = config.keep_alive_timeout_s
    hc.graceful_timeout = config.drain_timeout_s + FLUSH_MARGIN_S
    hc.websocket_max_message_size = config.max_ws_message_bytes
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


def bind_sockets(hc: HypercornConfig, config: ServerConfig) -> Sockets:
    """Bind now (before any model loads), so a busy port is one clear error at once; listen comes later."""
    try:
        return hc.create_sockets()
    except OSError as exc:
        raise ServeError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None


def check_unique_names(names: Sequence[str]) -> None:
    """Two models served under one name would hide each other."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ServeError(f"two models are served under the name {name!r}; give each its own "
                             "--served-model-name")
        seen.add(name)


def startup_message(url: str, model: str, api_key_set: bool) -> str:
    """Where to send requests, with a copy-paste curl example."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello in one sentence."}]})
    auth = ' -H "Authorization: Bearer $TRILLM_API_KEY"' if api_key_set else ""
    return (f"trillm is serving {model} at {url}/v1 (OpenAI-compatible; websocket {url.replace('http', 'ws', 1)}/v1/ws)\n"
            f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}")


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
    hypercorn stops accepting, each service drains (open requests may finish within drain_timeout_s; the
    rest end with an error event or message), websockets close, and then the engines stop. A shutdown
    while the models still load stops at once. `trillm serve --mock` goes through here too: only its
    ModelSpec differs.
    """
    check_unique_names([m.name for m in models if m.name is not None])
    hc = hypercorn_config(config)
    sockets = bind_sockets(hc, config)
    try:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            services: list[EngineService] = []
            up = False

            async def watch_for_shutdown(trigger: Callable[[], Awaitable[None]]) -> None:
                await trigger()
                stop.set()
                if not up:  # still loading: nothing to drain
                    log.info("shutting down while loading")
                    nursery.cancel_scope.cancel()

            if shutdown_trigger is not None:
                nursery.start_soon(watch_for_shutdown, shutdown_trigger)
            for spec in models:
                service: EngineService = await nursery.start(
                    EngineService(spec.factory, name=spec.name, config=service_config, inline=spec.inline).run)
                log.info("model %s: %s", service.model_name, service.state.value)
                services.append(service)
            check_unique_names([s.model_name for s in services])
            hubs = {s.model_name: KVEventHub(s, reveal_hashes=config.reveals_block_hashes) for s in services}
            if not config.reveals_block_hashes:
                log.warning("--api-key without --internal-api-key: /internal/kv-events hides block hashes from "
                            "API key holders, so a KV-aware router cannot route by prefix; give it its own "
                            "key (--internal-api-key here, --replica-api-key there)")
            for hub in hubs.values():
                nursery.start_soon(hub.run)
            try:
                quart_app = create_app(services, config)
            except ValueError as exc:  # an alias to a name that is known only now the models loaded
                raise ServeError(str(exc)) from None
            register_kv_events(quart_app, hubs)
            app = ShieldedFinalSend(quart_app)

            async def drain() -> None:
                await stop.wait()
                live = sum(s.statistics().num_live_requests for s in services)
                log.info("shutting down: %d requests may finish within %s s", live, config.drain_timeout_s)
                async with trio.open_nursery() as drains:
                    for s in services:
                        drains.start_soon(s.drain, config.drain_timeout_s)

            async def http(task_status: trio.TaskStatus[list[str]]) -> None:
                for sock in sockets.insecure_sockets:
                    sock.listen(config.backlog)
                await worker_serve(wrap_app(app, hc.wsgi_max_body_size, "asgi"), hc, sockets=sockets,
                                   shutdown_trigger=stop.wait, task_status=task_status)
                nursery.cancel_scope.cancel()  # HTTP has shut down gracefully: stop the engines

            nursery.start_soon(drain)
            binds = await nursery.start(http)
            up = True
            url = binds[0]
            if not is_loopback_host(config.host) and config.api_key is None:
                log.warning("listening on %s without --api-key: anyone who can reach it can use it", config.host)
            log.info("%s", startup_message(url, services[0].model_name, config.api_key is not None))
            task_status.started(Serving(url, tuple(services)))
    finally:
        for sock in sockets.insecure_sockets:
            sock.close()
