"""`trillm generate`: generate once from the command line (no server)."""

from __future__ import annotations

import argparse
import sys
import time

from trillm.engine.config import EngineConfig
from trillm.engine.errors import EngineError
from trillm.web.cli import DEFAULT_MODEL_HELP, DEFAULT_MODEL_NAME

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
