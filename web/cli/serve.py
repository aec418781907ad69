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
from trillm.engine.distributed import BACKENDS, launched_by_mlx
from trillm.engine.errors import EngineError
from trillm.engine.mock import add_mock_arguments
from trillm.web.chat.reasoning import REASONING_PARSERS
from trillm.web.chat.tool_parsers import TOOL_PARSERS
from trillm.web.cli import DEFAULT_MODEL_HELP, DEFAULT_MODEL_NAME, add_front_arguments, configure_logging
from trillm.web.config import ServeError, ServerConfig
from trillm.web.openai.request import Limits

if TYPE_CHECKING:
    from trillm.web.server import ModelSpec
    from trillm.web.service.engine_service import ServiceConfig

HELP = "serve an OpenAI-compatible HTTP/SSE and websocket API"
_LIMIT_FLAGS = tuple(f.name for f in fields(Limits))  # what one request may ask: web/openai/request.py Limits
_SERVER_FLAGS = ("max_request_bytes", "max_ws_message_bytes", "max_ws_generations", "max_ws_requests")
_LIMIT_HELP = {
    "max_prompt_bytes": "all the text one request carries (messages, tool calls and results, tool definitions); ",
    "max_engine_requests": "generations one request may start (its prompts x n); ",
    "max_response_bytes": "a non-streamed response's worst case (n x max_tokens x (1 + top_logprobs), echo, "
                          "prompt_logprobs), refused up front; streamed responses are not capped; ",
}


def configure(p: argparse.ArgumentParser) -> None:
    from trillm.web.service.engine_service import ServiceConfig

    add_front_arguments(p, pages="the websockets")
    p.add_argument("--model", action="append", default=None,
                   help=f"{DEFAULT_MODEL_HELP}; repeat to serve several models, each on its own engine thread")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="the name clients use (one per --model; default: the model's own)")
    p.add_argument("--internal-api-key", default=os.environ.get("TRILLM_INTERNAL_API_KEY"),
                   help="a router's own key: the only one /internal/* (the KV-event feed) takes, and the API takes "
                        "it too; without it, an --api-key server hides block hashes from the feed "
                        "(default: $TRILLM_INTERNAL_API_KEY)")
    limits = p.add_argument_group("limits on one request (defaults in README)")
    for name in _LIMIT_FLAGS:
        default = getattr(Limits(), name)
        limits.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            help=f"{_LIMIT_HELP.get(name, '')}default: {default}")
    for name in _SERVER_FLAGS:
        default = getattr(ServerConfig(), name)
        limits.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=f"default: {default}")
    limits.add_argument("--max-buffered-bytes", type=int, default=ServiceConfig().max_buffered_bytes,
                        help="unread output (text, token ids, logprobs) held for a slow client before its request "
                             "is aborted (default: %(default)s)")
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
    p.add_argument("--model-alias", action="append", default=[], dest="model_aliases", metavar="NAME=SERVED",
                   help="answer requests for NAME (a name or a glob such as 'claude-*') with the served model "
                        "SERVED, for agents that send their own model names; repeatable, first match wins")
    ops = p.add_argument_group("operations (docs/operations.md)")
    ops.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS", dest="request_timeout",
                     help="a request's deadline: past it the generation ends with finish reason 'timeout' (Anthropic: "
                          "max_tokens) and its KV blocks are freed; a client's X-Request-Timeout header may ask for "
                          "less (default: none)")
    ops.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                     help="export an OpenTelemetry trace of each request (spans: queue, prefill, decode, stream; the "
                          "caller's W3C traceparent honoured) to this OTLP/HTTP collector, e.g. "
                          "http://localhost:4318/v1/traces (needs trillm[otel])")
    ops.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="several API keys, one a line: 'NAME KEY [rpm=N] [concurrent=N]'; each key's name (never "
                          "the key) is in logs and /metrics; over a limit, 429 with Retry-After")
    ops.add_argument("--key-rpm", type=int, default=None, metavar="N",
                     help="--api-key-file: requests per minute of each key without its own rpm= (default: none)")
    ops.add_argument("--key-max-concurrent", type=int, default=None, metavar="N",
                     help="--api-key-file: requests in flight (a stream until its end) of each key without its own "
                          "concurrent= (default: none)")
    p.add_argument("--lazy-load", action="store_true", help="load each model on its first request")
    p.add_argument("--unload-after-idle", type=float, default=None, metavar="SECONDS",
                   help="free a model after this long without requests (the next request reloads it)")
    p.add_argument("--mock", action="store_true",
                   help="serve the mock engine (the real scheduler with a timing model, no weights); see its flags")
    p.add_argument("--speedup", type=float, default=1.0, help="--mock: run the timing model this many times faster")
    tp = p.add_argument_group("tensor parallelism")
    tp.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                    help="shard the model over N ranks on this host (mx.distributed ring over loopback; rank 0 "
                         "serves). Under mlx.launch the group's own size is used")
    tp.add_argument("--distributed-backend", default="any", choices=BACKENDS,
                    help="under mlx.launch: the mx.distributed backend to join (default: any)")
    tp.add_argument("--tp-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="a step that waits this long on the other ranks means one hangs: fail the model")
    add_engine_arguments(p)
    add_mock_arguments(p)


def run(args: argparse.Namespace) -> int:
    from trillm.engine.llm_engine import LLMEngine
    from trillm.engine.mock import mock_engine_factory
    from trillm.web.server import ModelSpec
    from trillm.web.service.engine_service import ServiceConfig

    configure_logging(args.log_level)
    models: list[str | None] = args.model or [None]
    names: list[str | None] = args.served_model_name or [None] * len(models)
    if len(names) != len(models):
        return _usage("give one --served-model-name per --model")
    if args.mock and args.model:
        return _usage("--mock serves the mock engine; it takes no --model")
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        return _usage("--tensor-parallel takes a number of ranks >= 1")
    if launched_by_mlx() or (args.tensor_parallel or 1) > 1:
        return _run_tensor_parallel(args, names[0])
    if args.lazy_load:  # requests must name a model before it is loaded, so fix the names now
        names = [n or _default_name(m) for n, m in zip(names, models)]
    try:
        aliases = parse_model_aliases(args.model_aliases)
    except ValueError as exc:
        return _usage(str(exc))
    fixed_names = [n for n in names if n is not None]
    if len(fixed_names) == len(names):  # otherwise the names are known once the models load
        for pattern, target in aliases:
            if target not in fixed_names:
                return _usage(f"--model-alias {pattern}={target}: no served model is named {target!r} "
                              f"(served: {', '.join(fixed_names)})")
    try:
        service_config = ServiceConfig(lazy_load=args.lazy_load, unload_after_idle_s=args.unload_after_idle,
                                       max_buffered_bytes=args.max_buffered_bytes)
        config = _server_config(args, aliases)
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
        trio.run(partial(serve, specs, config, service_config=service_config, shutdown_trigger=wait_for_stop_signal))
    except (KeyboardInterrupt, EngineError, ServeError, BaseExceptionGroup) as exc:
        return exit_code(exc)
    return 0


def parse_model_aliases(values: list[str]) -> tuple[tuple[str, str], ...]:
    """`NAME=SERVED` flags as (pattern, served name) pairs."""
    aliases = []
    for value in values:
        pattern, sep, target = value.partition("=")
        if not sep or not pattern.strip() or not target.strip():
            raise ValueError(f"--model-alias wants NAME=SERVED (e.g. 'claude-*=SmolLM2-135M-Instruct'), got {value!r}")
        aliases.append((pattern.strip(), target.strip()))
    return tuple(aliases)


def _server_config(args: argparse.Namespace, aliases: tuple[tuple[str, str], ...]) -> ServerConfig:
    from trillm.web.service import tracing
    from trillm.web.http.keys import load_key_file

    if args.otlp_traces_endpoint is not None:
        tracing.configure(args.otlp_traces_endpoint)

    for flag, value in (("--key-rpm", args.key_rpm), ("--key-max-concurrent", args.key_max_concurrent)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1")
    keys = () if args.api_key_file is None else tuple(load_key_file(
        args.api_key_file, default_rpm=args.key_rpm, default_concurrent=args.key_max_concurrent))
    return ServerConfig(api_keys=keys, host=args.host, port=args.port, api_key=args.api_key, internal_api_key=args.internal_api_key,
                        allowed_origins=tuple(args.allowed_origins), model_aliases=aliases,
                        tool_parser=args.tool_parser, reasoning_parser=args.reasoning_parser,
                        drain_timeout_s=args.drain_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                        request_timeout_s=args.request_timeout,
                        limits=Limits(**{name: getattr(args, name) for name in _LIMIT_FLAGS}),
                        **{name: getattr(args, name) for name in _SERVER_FLAGS})


def _run_tensor_parallel(args: argparse.Namespace, name: str | None) -> int:
    """One model over a tensor-parallel group: started here (--tensor-parallel N), or by mlx.launch, whose
    rank 0 serves while every other rank runs the worker loop."""
    import trio

    from trillm.engine.distributed import TensorParallelError, TensorParallelGroup
    from trillm.web.service.engine_service import ServiceConfig
    from trillm.web.tp import TensorParallelOptions, serve_tensor_parallel

    for flag, given in (("--mock", args.mock), ("several --model", len(args.model or []) > 1),
                        ("--lazy-load", args.lazy_load), ("--unload-after-idle", args.unload_after_idle)):
        if given:
            return _usage(f"tensor parallelism serves one model, loaded at start-up: it does not take {flag}")
    tp = None
    if launched_by_mlx():
        try:
            tp = TensorParallelGroup.connect(args.distributed_backend)
        except TensorParallelError as exc:
            return _usage(str(exc))
        if args.tensor_parallel not in (None, tp.size):
            return _usage(f"--tensor-parallel {args.tensor_parallel} but the launcher started {tp.size} ranks")
        if tp.rank != 0:
            from trillm.engine.tp_worker import run_worker

            signal.signal(signal.SIGINT, signal.SIG_DFL)  # blocked in a collective, Python could not react
            return run_worker(tp)
    try:
        options = TensorParallelOptions(tp.size if tp is not None else args.tensor_parallel, args.tp_timeout)
        config = _server_config(args, parse_model_aliases(args.model_aliases))
        engine_config = engine_config_from_args(args, (args.model or [None])[0])
    except (ValueError, EngineError) as exc:
        return _usage(str(exc))
    if tp is not None and tp.size == 1:
        return _usage("the launcher started a single rank: run `trillm serve` without it")
    try:
        failure = trio.run(partial(serve_tensor_parallel, name, engine_config, config, options, tp=tp,
                                   service_config=ServiceConfig(max_buffered_bytes=args.max_buffered_bytes),
                                   shutdown_trigger=wait_for_stop_signal))
    except (KeyboardInterrupt, EngineError, ServeError, BaseExceptionGroup) as exc:
        return exit_code(exc)
    return 1 if failure is not None else 0


def _usage(message: str) -> int:
    print(f"trillm serve: {message}", file=sys.stderr)
    return 2


def _default_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name.removesuffix(".gguf") or model


async def wait_for_stop_signal() -> None:
    """Return on SIGINT or SIGTERM (a graceful shutdown: hypercorn's shutdown_trigger)."""
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logging.getLogger("trillm.web.cli.serve").info("%s: shutting down", signal.Signals(signum).name)
            return


def exit_code(exc: BaseException, command: str = "serve") -> int:
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
    print(f"trillm {command}: {exc}", file=sys.stderr)
    return 1
