"""`trillm route`: one OpenAI-compatible front over several trillm replicas, KV-aware by default."""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

from trillm.web.cli import add_front_arguments, configure_logging

HELP = "route requests over several trillm replicas (KV-aware: to the replica caching the longest prefix)"


def configure(p: argparse.ArgumentParser) -> None:
    from trillm.web.router.policy import CostWeights

    add_front_arguments(p, pages="its websocket (besides the router's own pages)")
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each replica)")
    p.add_argument("--policy", choices=("kv", "round-robin", "least-loaded"), default="kv",
                   help="kv: lowest prefill-blocks-not-cached x weight + load (default); or round-robin, "
                        "least-loaded")
    weights = CostWeights()
    p.add_argument("--prefill-weight", type=float, default=weights.prefill_weight,
                   help="kv: cost of one prompt block to prefill there, in KV blocks in use (default: %(default)s)")
    p.add_argument("--request-weight", type=float, default=weights.request_weight,
                   help="kv: cost of one running or waiting request, in KV blocks in use (default: %(default)s)")
    p.add_argument("--tokenizer", default="auto", metavar="auto|remote|PATH",
                   help="how the router computes prompt token ids: auto (locally where it can build the "
                        "replicas' tokenizer, else the replica's /tokenize), remote, or a model file/folder to "
                        "load the tokenizer from")
    p.add_argument("--replica-api-key", default=os.environ.get("TRILLM_REPLICA_API_KEY"),
                   help="the key the replicas require (default: $TRILLM_REPLICA_API_KEY; unset: forward the "
                        "client's Authorization header)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20)


def open_relay_warning(host: str, api_key: str | None, replica_api_key: str | None) -> str | None:
    """The warning for a router that would lend its replica key to anyone who can reach it, or None (a name or a
    wildcard like 0.0.0.0 is reachable from elsewhere)."""
    from trillm.web.http.guards import is_loopback_host

    if replica_api_key is None or api_key is not None or is_loopback_host(host):
        return None
    return (f"trillm route: warning: listening on {host} with --replica-api-key and no --api-key: anyone who can "
            "reach the router uses the replicas with their key; set --api-key (or $TRILLM_API_KEY)")


def run(args: argparse.Namespace) -> int:
    import trio

    from trillm.engine.errors import EngineError
    from trillm.web.cli.serve import exit_code, wait_for_stop_signal
    from trillm.web.config import ServerConfig
    from trillm.web.router.app import route
    from trillm.web.router.config import RouterConfig
    from trillm.web.router.policy import CostWeights

    configure_logging(args.log_level)
    if (warning := open_relay_warning(args.host, args.api_key, args.replica_api_key)) is not None:
        print(warning, file=sys.stderr)
    try:
        config = RouterConfig(
            tuple(u.rstrip("/") for u in args.replica),
            ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                         max_request_bytes=args.max_request_bytes, allowed_origins=tuple(args.allowed_origins)),
            policy=args.policy, weights=CostWeights(args.prefill_weight, 1.0, args.request_weight),
            tokenizer=args.tokenizer, replica_api_key=args.replica_api_key, health_interval_s=args.health_interval,
        )
    except (ValueError, EngineError) as exc:
        print(f"trillm route: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(partial(route, config, shutdown_trigger=wait_for_stop_signal))
    except (KeyboardInterrupt, EngineError, BaseExceptionGroup) as exc:
        return exit_code(exc, "route")
    return 0
