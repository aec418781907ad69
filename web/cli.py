"""The `trillm` command: the one dispatcher that names every subcommand.

`serve`, `route` and `generate` live in trillm.web; `simulate` and `bench` are developer tools in trillm.bench, loaded by name
only when asked for (web never imports bench). Each subcommand module provides HELP, configure(parser) and
run(args) -> exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Protocol

from trillm.engine.config import EngineConfig
from trillm.engine.errors import EngineError

DEFAULT_MODEL_HELP = "model path or GGUF file (default: the bundled SmolLM2-135M-Instruct)"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class Command(Protocol):
    HELP: str

    def configure(self, parser: argparse.ArgumentParser) -> None: ...
    def run(self, args: argparse.Namespace) -> int: ...


# name -> module; loaded when the parser is built, so keep their top-level imports light.
SUBCOMMANDS: dict[str, str] = {
    "serve": "trillm.web.cli_serve",
    "route": "trillm.web.cli_route",
    "generate": "trillm.web.cli",
    "simulate": "trillm.bench.simulate",
    "bench": "trillm.bench.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trillm", description="An async-native LLM generation service.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module: Command = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `trillm` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # a group with its own dispatcher: everything after `bench` is its own
        bench: Command = importlib.import_module(SUBCOMMANDS["bench"])
        return int(bench.run(argparse.Namespace(argv=argv[1:])))
    args = build_parser().parse_args(argv)
    return int(args.run(args))


# ---- trillm generate ----------------------------------------------------------------------------------------

HELP = "generate once from the command line (no server)"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help=DEFAULT_MODEL_HELP)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, without the chat template")


def run(args: argparse.Namespace) -> int:
    from trillm.engine.llm_engine import LLMEngine
    from trillm.engine.sampling_params import SamplingParams

    what = args.model or f"the default model ({DEFAULT_MODEL_NAME})"
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


if __name__ == "__main__":
    raise SystemExit(main())
