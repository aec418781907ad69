"""`trillm serve`: serve models (or, with --mock, the mock engine) over the OpenAI-compatible API."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import fields
from functools import partial
from typing import TYPE_CHECKING

from trillm.engine.config import add_engine_arguments, engine_config_from_args
from trillm.engine.errors import EngineError
from trillm.engine.mock import add_mock_arguments
from trillm.web.config import ServeError, ServerConfig
from trillm.web.protocol import Limits
from trillm.web.reasoning import REASONING_PARSERS
from trillm.web.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from trillm.web.server import ModelSpec
    from trillm.web.service import ServiceConfig

HELP = "serve an OpenAI-compatible HTTP/SSE and websocket API"
_LIMIT_FLAGS = tuple(f.name for f in fields(Limits))  # what one request may ask: web/protocol.py Limits
_SERVER_FLAGS = ("max_request_bytes", "max_ws_message_bytes", "max_ws_generations", "max_ws_requests")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def configure(p: argparse.ArgumentParser) -> None:
    from trillm.web.service import ServiceConfig

    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", action="append", default=None,
                   help="model path or GGUF file (default: the bundled SmolLM2-135M-Instruct); repeat to serve "
                        "several models, each on its own engine thread")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="the name clients use (one per --model; default: the model's own)")
    p.add_argument("--api-key", default=os.environ.get("TRILLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TRILLM_API_KEY)")
    limits = p.add_argument_group("limits on one request (defaults in README)")
    for name in _LIMIT_FLAGS:
        default = getattr(Limits(), name)
        limits.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=f"default: {default}")
    for name in _SERVER_FLAGS:
        default = getattr(ServerConfig(), name)
        limits.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=f"default: {default}")
    limits.add_argument("--max-buffered-bytes", type=int, default=ServiceConfig().max_buffered_bytes,
                        help="unread output (text, token ids, logprobs) held for a slow client before its request "
                             "is aborted (default: %(default)s)")
    p.add_argument("--allowed-origin", action="append", default=[], dest="allowed_origins",
                   help="a web page origin (scheme://host:port) allowed to open the websockets; repeatable")
    p.add_argument("--tool-parser", default=None, choices=TOOL_PARSERS,
                   help="the tool-call format (default: detected from the chat template; 'generic' puts the tools "
                        "into the system prompt)")
    p.add_argument("--reasoning-parser", default=None, choices=(*REASONING_PARSERS, "none"),
                   help="the reasoning markers to split off as reasoning_content (default: detected; none: off)")
    p.add_argument("--drain-timeout", type=float, default=ServerConfig().drain_timeout_s, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, open requests may finish for this long; then they end with an error "
                        "event (SSE) or message (websocket) (default: %(default)s)")
    p.add_argument("--keep-alive-timeout", type=float, default=ServerConfig().keep_alive_timeout_s,
                   metavar="SECONDS", help="close an idle HTTP connection after this long (default: %(default)s)")
    p.add_argument("--lazy-load", action="store_true", help="load each model on its first request")
    p.add_argument("--unload-after-idle", type=float, default=None, metavar="SECONDS",
                   help="free a model after this long without requests (the next request reloads it)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--mock", action="store_true",
                   help="serve the mock engine (the real scheduler with a timing model, no weights); see its flags")
    p.add_argument("--speedup", type=float, default=1.0, help="--mock: run the timing model this many times faster")
    add_engine_arguments(p)
    add_mock_arguments(p)


def run(args: argparse.Namespace) -> int:
    from trillm.engine.llm_engine import LLMEngine
    from trillm.engine.mock import mock_engine_factory
    from trillm.web.server import ModelSpec
    from trillm.web.service import ServiceConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    models: list[str | None] = args.model or [None]
    names: list[str | None] = args.served_model_name or [None] * len(models)
    if len(names) != len(models):
        return _usage("give one --served-model-name per --model")
    if args.mock and args.model:
        return _usage("--mock serves the mock engine; it takes no --model")
    if args.lazy_load:  # requests must name a model before it is loaded, so fix the names now
        names = [n or _default_name(m) for n, m in zip(names, models)]
    try:
        service_config = ServiceConfig(lazy_load=args.lazy_load, unload_after_idle_s=args.unload_after_idle,
                                       max_buffered_bytes=args.max_buffered_bytes)
        config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                              allowed_origins=tuple(args.allowed_origins), tool_parser=args.tool_parser,
                              reasoning_parser=args.reasoning_parser, drain_timeout_s=args.drain_timeout,
                              keep_alive_timeout_s=args.keep_alive_timeout,
                              limits=Limits(**{name: getattr(args, name) for name in _LIMIT_FLAGS}),
                              **{name: getattr(args, name) for name in _SERVER_FLAGS})
        if args.mock:
            specs = [ModelSpec(names[0], mock_engine_factory(args, engine_config_from_args(args), speedup=args.speedup),
                               inline=True)]
        else:
            specs = [ModelSpec(name, partial(LLMEngine, engine_config_from_args(args, model)))
                     for name, model in zip(names, models)]
    except (ValueError, OSError, EngineError) as exc:
        return _usage(str(exc))
    return serve_until_stopped(specs, config, service_config)


def serve_until_stopped(specs: list[ModelSpec], config: ServerConfig, service_config: ServiceConfig) -> int:
    """Serve until SIGTERM or SIGINT (then drain, see serve()); the exit code, with one line for typed errors."""
    import trio

    from trillm.web.server import serve

    try:
        trio.run(partial(serve, specs, config, service_config=service_config, shutdown_trigger=_wait_for_stop_signal))
    except (KeyboardInterrupt, EngineError, ServeError, BaseExceptionGroup) as exc:
        return _exit_code(exc)
    return 0


def _usage(message: str) -> int:
    print(f"trillm serve: {message}", file=sys.stderr)
    return 2


def _default_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name.removesuffix(".gguf") or model


async def _wait_for_stop_signal() -> None:
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logging.getLogger("trillm.web.cli").info("%s: shutting down", signal.Signals(signum).name)
            return


def _exit_code(exc: BaseException) -> int:
    """Typed errors (the model could not be loaded, the port is busy) become one clear line, not a traceback."""
    if isinstance(exc, BaseExceptionGroup):
        engine_errors, rest = exc.split((EngineError, ServeError))
        if rest is not None and rest.split(KeyboardInterrupt)[1] is not None:
            raise exc
        if engine_errors is None:
            return 0
        first: BaseException = engine_errors
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        exc = first
    if isinstance(exc, KeyboardInterrupt):
        return 0
    print(f"trillm serve: {exc}", file=sys.stderr)
    return 1
