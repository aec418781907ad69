"""The `trillm` command: `serve`, `generate` and `bench`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial

from trillm.engine.config import EngineConfig
from trillm.engine.errors import EngineError

DEFAULT_MODEL_HELP = "model path or GGUF file (default: the bundled SmolLM2-135M-Instruct)"


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: sized from --kv-cache-memory-gb)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    g.add_argument("--max-num-seqs", type=int, default=64, help="largest running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step; the prefill chunk")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-waiting", type=int, default=1024, help="queued requests before 503 Overloaded")
    g.add_argument("--dtype", default=None, help="default: float32 on CPU, the checkpoint's dtype on GPU")


def _engine_config(args: argparse.Namespace, model: str | None) -> EngineConfig:
    return EngineConfig(
        model=model, dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trillm", description="An async-native LLM generation service.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP/SSE and websocket API")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", action="append", default=None,
                   help=DEFAULT_MODEL_HELP + "; repeat to serve several models, each on its own engine thread")
    s.add_argument("--served-model-name", action="append", default=None,
                   help="the name clients use (one per --model; default: the model's own)")
    s.add_argument("--api-key", default=os.environ.get("TRILLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TRILLM_API_KEY)")
    s.add_argument("--max-request-bytes", type=int, default=4 << 20)
    s.add_argument("--max-prompt-tokens", type=int, default=None)
    s.add_argument("--max-tokens-limit", type=int, default=None, help="the largest max_tokens a request may ask")
    s.add_argument("--lazy-load", action="store_true", help="load each model on its first request")
    s.add_argument("--unload-after-idle", type=float, default=None, metavar="SECONDS",
                   help="free a model after this long without requests (the next request reloads it)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--mock", action="store_true",
                   help="serve the mock engine (timing model, no weights); its flags: `trillm serve --mock --help`")
    _add_engine_flags(s)

    g = sub.add_parser("generate", help="generate once from the command line (no server)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help=DEFAULT_MODEL_HELP)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, without the chat template")

    sub.add_parser("bench", help="benchmarks: `trillm bench --help`", add_help=False)
    sub.add_parser("simulate", help="replay a request trace on the mock engine in virtual time: `trillm simulate --help`",
                   add_help=False)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from trillm.engine.llm_engine import LLMEngine
    from trillm.web.config import ServerConfig
    from trillm.web.server import serve
    from trillm.web.service import Engine, ServiceConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    models: list[str | None] = args.model or [None]
    names: list[str | None] = args.served_model_name or [None] * len(models)
    if len(names) != len(models):
        print("trillm serve: give one --served-model-name per --model", file=sys.stderr)
        return 2
    if args.lazy_load:  # requests must name a model before it is loaded, so fix the names now
        names = [n or _default_name(m) for n, m in zip(names, models)]
    try:
        service_config = ServiceConfig(lazy_load=args.lazy_load, unload_after_idle_s=args.unload_after_idle)
        config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                              max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
                              max_tokens_limit=args.max_tokens_limit)
        engines: list[tuple[str | None, Callable[[], Engine]]] = [
            (name, partial(LLMEngine, _engine_config(args, model))) for name, model in zip(names, models)]
    except (ValueError, EngineError) as exc:
        print(f"trillm serve: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(partial(serve, engines, config, service_config=service_config,
                         shutdown_trigger=_wait_for_stop_signal))
    except (KeyboardInterrupt, EngineError, BaseExceptionGroup) as exc:
        return _exit_code(exc, "trillm serve")
    return 0


def _default_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(model))
    return name.removesuffix(".gguf") or model


async def _wait_for_stop_signal() -> None:
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logging.getLogger("trillm.web.cli").info("%s: shutting down", signal.Signals(signum).name)
            return


def _exit_code(exc: BaseException, prog: str) -> int:
    """Typed errors (e.g. the model could not be loaded) become one clear line, not a traceback."""
    if isinstance(exc, BaseExceptionGroup):
        engine_errors, rest = exc.split(EngineError)
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
    print(f"{prog}: {exc}", file=sys.stderr)
    return 1


def cmd_generate(args: argparse.Namespace) -> int:
    from trillm.engine.llm_engine import LLMEngine
    from trillm.engine.sampling_params import SamplingParams

    what = args.model or "the default model (SmolLM2-135M-Instruct)"
    print(f"loading {what} ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=1, max_num_batched_tokens=512))
        tok = engine.tokenizer
        ids = (tok.encode(args.prompt, add_special_tokens=True) if args.no_chat
               else tok.apply_chat_template([{"role": "user", "content": args.prompt}]))
        engine.add_request("cli", ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                      seed=args.seed))
    except EngineError as exc:
        print(f"\ntrillm generate: {exc}", file=sys.stderr)
        return 1
    print(f" ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    t1 = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    dt = time.perf_counter() - t1
    print(f"[{len(ids)} prompt tokens, {n} generated in {dt:.2f} s: {n / dt if dt else 0:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_bench(argv: list[str]) -> int:
    try:
        from trillm.bench.cli import main as bench_main
    except ModuleNotFoundError as exc:
        if exc.name not in ("trillm.bench.cli",):
            raise
        print("trillm bench: the benchmark CLI (trillm.bench.cli) is not in this checkout", file=sys.stderr)
        return 2
    return int(bench_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `trillm` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "bench":  # everything after `bench` belongs to the bench CLI
        return cmd_bench(args_list[1:])
    # The mock engine and simulator (issue 6) have their own flags: web/mock_serve.py, web/simulate.py.
    if args_list[:1] == ["simulate"]:
        from trillm.web.simulate import main as simulate_main

        return simulate_main(args_list[1:])
    if args_list[:1] == ["serve"] and "--mock" in args_list:
        from trillm.web.mock_serve import main as mock_serve_main

        return mock_serve_main(args_list[1:])
    args = build_parser().parse_args(args_list)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "generate":
        return cmd_generate(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
