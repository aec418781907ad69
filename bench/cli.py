"""`trillm bench ...`: one CLI for every benchmark. Subcommands import lazily, so a missing one fails alone."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# subcommand -> (module, what it measures)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("trillm.bench.serve", "measure OpenAI-compatible servers (SSE or trillm's websocket), like vLLM"),
    "peers": ("trillm.bench.peers", "start trillm and mlx_lm.server on one model and compare them"),
    "engine": ("trillm.bench.bench_engine", "the engine without HTTP"),
    "kernels": ("trillm.bench.bench_kernels", "the paged-KV kernels against their references"),
    "overhead": ("trillm.bench.bench_serving_overhead", "what the web layer adds over the engine"),
    "profile": ("trillm.bench.profile", "time the engine's steps and fit the mock engine's timing model"),
    "mock-parity": ("trillm.bench.bench_mock_parity", "the simulator's TTFT/ITL against the real engine on one trace"),
}


def _usage() -> str:
    lines = ["usage: trillm bench <subcommand> [flags]   (each takes --help)", "", "subcommands:"]
    lines += [f"  {name:<9} {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def _load(name: str) -> Callable[[list[str] | None], int] | None:
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the module exists but something it imports is missing
            raise
        return None
    main = getattr(module, "main", None)
    return main if callable(main) else None


def main(argv: list[str] | None = None) -> int:
    """Dispatch `trillm bench <subcommand> ...` to the subcommand's own main(argv)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"trillm bench: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    sub_main = _load(name)
    if sub_main is None:
        print(
            f"trillm bench {name}: not available in this checkout ({SUBCOMMANDS[name][0]} is missing or has no "
            "main(argv))",
            file=sys.stderr,
        )
        return 2
    return int(sub_main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
