"""The `trillm` command: the one dispatcher that names every subcommand.

`serve`, `route` and `generate` live in trillm.web; `simulate` and `bench` are developer tools in trillm.bench, loaded by name
only when asked for (web never imports bench). Each subcommand module provides HELP, configure(parser) and
run(args) -> exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Protocol

DEFAULT_MODEL_HELP = "model path or GGUF file (default: the bundled SmolLM2-135M-Instruct)"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class Command(Protocol):
    HELP: str

    def configure(self, parser: argparse.ArgumentParser) -> None: ...
    def run(self, args: argparse.Namespace) -> int: ...


# name -> module; loaded when the parser is built, so keep their top-level imports light.
SUBCOMMANDS: dict[str, str] = {
    "serve": "trillm.web.cli.serve",
    "route": "trillm.web.cli.route",
    "generate": "trillm.web.cli.generate",
    "simulate": "trillm.bench.simulate",
    "bench": "trillm.bench.cli",
}


def add_front_arguments(p: argparse.ArgumentParser, *, pages: str) -> None:
    """The flags a server and the router share: where they listen, the API key, page origins, the log level."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TRILLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TRILLM_API_KEY)")
    p.add_argument("--allowed-origin", action="append", default=[], dest="allowed_origins", metavar="ORIGIN",
                   help=f"a web page origin (scheme://host:port) allowed to open {pages}; repeatable")
    p.add_argument("--log-level", default="info")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
