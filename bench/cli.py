"""`trillm bench ...`: one CLI for every benchmark; each subcommand's module is imported only when run."""

from __future__ import annotations

import argparse
import importlib
import sys

HELP = "benchmarks: `trillm bench --help`"

# subcommand -> (module with main(argv), what it measures)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("trillm.bench.serve", "measure OpenAI-compatible servers (SSE or trillm's websocket), like vLLM"),
    "serve-spec": ("trillm.bench.serve_spec", "two trillm servers, speculative decoding on and off, side by side"),
    "peers": ("trillm.bench.peers", "start trillm, mlx_lm.server and llama.cpp on one model and compare them"),
    "llama-cpp": ("trillm.bench.llama_cpp", "llama.cpp's server for bench peers: install it, export its F32 GGUF"),
    "engine": ("trillm.bench.engine", "the engine without HTTP"),
    "kernels": ("trillm.bench.kernels", "the paged-KV kernels against their references"),
    "overhead": ("trillm.bench.overhead", "what the web layer adds over the engine"),
    "profile": ("trillm.bench.profile", "time the engine's steps and fit the mock engine's timing model"),
    "profile-ops": ("trillm.bench.profile_ops", "where one engine step spends its time, per op kind"),
    "mock-parity": ("trillm.bench.mock_parity", "the simulator's TTFT/ITL against the real engine on one trace"),
    "soak": ("trillm.bench.soak", "a long mixed load with disconnects: 5xx, leaked blocks, RSS growth, p99"),
    "score": ("trillm.bench.score", "prompt-logprob scoring throughput against plain prefill"),
    "tp": ("trillm.bench.tp", "tensor parallelism: 1 vs N ranks on this host, collectives, N-machine estimate"),
    "router": ("trillm.bench.router", "KV-aware routing vs round-robin over mock replicas; the router's overhead"),
    "window": ("trillm.bench.window", "sliding-window decode at long context: the model's windows vs full attention"),
    "quant-memory": ("trillm.bench.quant_memory", "resident memory after load, weights kept quantized vs float32"),
    "kv-cache": ("trillm.bench.kv_cache", "the KV cache's dtype (int8, fp16 vs fp32): accuracy, capacity, decode at 8k"),
    "kv-disk": ("trillm.bench.kv_disk", "the prefix cache's disk tier: TTFT after a restart, more prefixes than memory"),
}


def _usage() -> str:
    lines = ["usage: trillm bench <subcommand> [flags]   (each takes --help)", "", "subcommands:"]
    lines += [f"  {name:<11} {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("argv", nargs=argparse.REMAINDER, help="a subcommand and its flags")


def run(args: argparse.Namespace) -> int:
    return main(args.argv)


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
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
