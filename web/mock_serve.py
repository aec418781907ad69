"""`trillm serve --mock`: the usual HTTP, SSE and websocket API on the mock engine, in real time.

The same InlineEngineService that `trillm simulate` runs on a virtual clock, here on trio's real clock with
each step's predicted duration divided by --speedup. Adds /internal/kv-events (per-step load and KV events).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import trio
from hypercorn.trio import serve as hypercorn_serve

from trillm.engine.mock.events import EngineObserver
from trillm.web.app import create_app
from trillm.web.asgi import ShieldedFinalSend
from trillm.web.config import ServerConfig
from trillm.web.kv_events import KVEventHub, register_kv_events
from trillm.web.mock_service import InlineEngineService
from trillm.web.server import hypercorn_config
from trillm.web.service import Engine, ServiceConfig
from trillm.web.simulate import add_engine_args, engine_factory_from_args

log = logging.getLogger("trillm.web.mock_serve")


@dataclass(frozen=True, slots=True)
class MockServing:
    url: str
    service: InlineEngineService
    hub: KVEventHub


def observed(factory: Callable[[], Engine]) -> tuple[Callable[[], Engine], list[EngineObserver]]:
    """Wrap each engine the factory builds in an EngineObserver (remembered in the returned list)."""
    made: list[EngineObserver] = []

    def build() -> Engine:
        engine = factory()
        runner = engine.runner  # type: ignore[attr-defined]
        obs = EngineObserver(engine, step_seconds=lambda: runner.last_step_s)  # type: ignore[arg-type]
        made.append(obs)
        return obs  # type: ignore[return-value]

    return build, made


async def serve_mock(factory: Callable[[], Engine], config: ServerConfig = ServerConfig(), *,
                     name: str | None = None, service_config: ServiceConfig = ServiceConfig(),
                     task_status: trio.TaskStatus[MockServing] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the mock engine until cancelled; reports a MockServing once requests are accepted."""
    build, observers = observed(factory)
    async with trio.open_nursery() as nursery:
        service = await nursery.start(InlineEngineService(build, name=name, config=service_config).run)
        hub = KVEventHub(service.model_name, observers[-1])
        nursery.start_soon(hub.run)
        app = create_app([service], config)
        register_kv_events(app, {service.model_name: hub})

        @app.get("/internal/mock-stats")
        async def mock_stats() -> dict[str, object]:
            """Leak check for load tests: live handles, engine queues and KV blocks right now."""
            engine = service.engine
            assert engine is not None
            bm = engine.block_manager  # type: ignore[attr-defined]
            return {"live_requests": len(service._live), "unfinished": engine.has_unfinished_requests(),
                    "kv_blocks_used": bm.num_used_blocks, "kv_subscribers": hub.num_subscribers,
                    "steps": service.num_steps}
        binds = await nursery.start(partial(hypercorn_serve, ShieldedFinalSend(app), hypercorn_config(config),
                                            mode="asgi"))
        log.info("serving the mock engine %s at %s (KV events: %s/internal/kv-events)", service.model_name,
                 binds[0], binds[0].replace("http", "ws", 1))
        task_status.started(MockServing(binds[0], service, hub))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trillm serve --mock", description=__doc__)
    p.add_argument("--mock", action="store_true", help="(implied)")
    p.add_argument("--speedup", type=float, default=1.0, help="run the timing model this many times faster")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--log-level", default="info")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.speedup <= 0:
        print("trillm serve --mock: --speedup must be > 0", file=sys.stderr)
        return 2
    factory, _ = engine_factory_from_args(args, speedup=args.speedup)
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key)
    try:
        trio.run(partial(serve_mock, factory, config, name=args.served_model_name))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
