"""A minimal `trillm serve` for benchmarks, used only where trillm.web.cli is not available.

It builds the same server (`trillm.web.server.serve` over one LLMEngine) with the few flags `bench peers` needs.
"""

from __future__ import annotations

import argparse
import logging

import trillm.kernels  # noqa: F401  (BLAS before mlx)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trillm.bench.trillm_launch", description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-caching", action="store_true")
    args = p.parse_args(argv)

    import trio

    from trillm.engine.config import EngineConfig
    from trillm.engine.llm_engine import LLMEngine
    from trillm.web.config import ServerConfig
    from trillm.web.server import serve

    logging.basicConfig(level=logging.INFO)
    config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                          enable_prefix_caching=not args.no_prefix_caching)
    trio.run(lambda: serve([(None, lambda: LLMEngine(config))], ServerConfig(host=args.host, port=args.port)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
