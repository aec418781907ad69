"""`trillm bench profile`: measure the real engine's step times and fit the mock engine's timing model.

Decode steps are timed across batch sizes and context lengths (the batch shares its prompt's prefix, so setting
up a long context costs one prefill, not B), prefill chunks across chunk sizes and the context before them.
Each step is timed around the engine's runner (one forward per decode batch / prefill chunk, then one host
sync), exactly the unit engine/mock/timing.py predicts. Writes profile.json (samples + linear fit), which
`trillm simulate --profile` and `trillm serve --mock --profile` read, and prints each sample's fit error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trillm.bench.harness.results import int_list, new_results_dir, write_meta
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.scheduler import ScheduledBatch
from trillm.engine.mock.timing import (
    DecodeSample, PrefillSample, StepShape, load_perf_model, relative_error, save_profile,
)


class StepTimer:
    """Records each `engine.step()`'s time (the engine's "step" phase) with the shape of the step it read back.

    With pipelined decode a step launches step n+1 and then waits for step n, so in steady state the time
    between step() returns is one step's duration, which is what the mock engine predicts. The shape is
    taken when the step is launched (the batch's counts are committed then).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[tuple[int, ...], tuple[tuple[int, int], ...], float]] = []
        shapes: dict[int, StepShape] = {}

        def on_phase(phase: str, seconds: float, batch: ScheduledBatch | None) -> None:
            if phase == "launch" and batch is not None:
                shapes[id(batch)] = StepShape.of(batch, 2)
            elif phase == "step" and batch is not None:
                shape = shapes.pop(id(batch))
                self.steps.append((shape.decode_contexts, shape.prefill_chunks, seconds))

        engine.on_phase = on_phase


def _engine(loaded: Any, *, max_num_seqs: int, budget: int, tokens: int, block_size: int = 16) -> Any:
    from trillm.engine.config import EngineConfig
    from trillm.engine.llm_engine import LLMEngine

    blocks = max_num_seqs * (-(-tokens // block_size) + 2) + 4
    config = EngineConfig(block_size=block_size, num_kv_blocks=blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(budget, max_num_seqs), max_model_len=tokens + 64)
    return LLMEngine(config, loaded=loaded)


def profile_decode(loaded: Any, batch: int, context: int, steps: int, log: Callable[[str], None]) -> list[DecodeSample]:
    """batch sequences with a shared context-token prompt; times `steps` decode steps after one warm-up."""
    from trillm.engine.sampling_params import SamplingParams

    engine = _engine(loaded, max_num_seqs=batch, budget=512, tokens=context + steps + 4)
    vocab = engine.tokenizer.vocab_size
    prefix = [(7 * i + 11) % (vocab - 10) + 5 for i in range(context - 1)]
    params = SamplingParams(max_tokens=steps + 3, ignore_eos=True)
    engine.add_request("p0", prefix + [5], params)
    while engine.scheduler.waiting or any(s.num_pending_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # the first sequence's prefill, so the others hit the prefix cache
    for i in range(1, batch):
        engine.add_request(f"p{i}", prefix + [5 + i % 5], params)
    while engine.scheduler.waiting or any(s.num_pending_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    timer = StepTimer(engine)
    for _ in range(steps + 2):
        engine.step()
    out = []
    for ctxs, chunks, seconds in timer.steps[2:]:  # a new batch shape's first steps pay one-time costs
        if chunks or len(ctxs) != batch:
            continue
        out.append(DecodeSample(batch, context, seconds))
    while engine.has_unfinished_requests():
        engine.step()
    if out:
        log(f"decode  batch {batch:3d} context {context:5d}: {statistics.median(s.seconds for s in out) * 1000:8.1f} ms")
    return out


def profile_prefill(loaded: Any, chunk: int, num_chunks: int, log: Callable[[str], None]) -> list[PrefillSample]:
    """One prompt of chunk * num_chunks tokens with a budget of `chunk`: a sample per chunk (start 0, chunk, ...)."""
    from trillm.engine.sampling_params import SamplingParams

    engine = _engine(loaded, max_num_seqs=1, budget=chunk, tokens=chunk * num_chunks + 2)
    vocab = engine.tokenizer.vocab_size
    prompt = [(13 * i + 3) % (vocab - 10) + 5 for i in range(chunk * num_chunks)]
    timer = StepTimer(engine)
    engine.add_request("q", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    out = [PrefillSample(c[0][0], c[0][1], s) for d, c, s in timer.steps if len(c) == 1 and not d]
    for s in out:
        log(f"prefill chunk {s.tokens:5d} start {s.start:5d}: {s.seconds * 1000:8.1f} ms")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trillm bench profile", description=__doc__)
    p.add_argument("--model", default=None, help="model (default: the default model)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", type=int_list, default=[1, 2, 4, 8, 16], help="decode batch sizes, comma-separated")
    p.add_argument("--contexts", type=int_list, default=[32, 128, 512], help="decode context lengths")
    p.add_argument("--chunks", type=int_list, default=[16, 64, 256], help="prefill chunk sizes")
    p.add_argument("--num-chunks", type=int, default=3, help="chunks per prefill prompt (starts 0, c, 2c, ...)")
    p.add_argument("--steps", type=int, default=6, help="timed decode steps per (batch, context); the median counts")
    p.add_argument("--out", default=None, help="profile JSON path (default RESULTS_DIR/<timestamp>/profile.json)")
    p.add_argument("--results-dir", default="results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from trillm.engine.loader import load_model
    from trillm.engine.sampling_params import SamplingParams

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype)
    warm = _engine(loaded, max_num_seqs=2, budget=64, tokens=64)
    warm.generate([[5, 6, 7, 8] * 4, [9, 10] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # first-call costs
    decode: list[DecodeSample] = []
    for context in args.contexts:
        for batch in args.batches:
            decode += profile_decode(loaded, batch, context, args.steps, log)
    prefill: list[PrefillSample] = []
    for chunk in args.chunks:
        prefill += profile_prefill(loaded, chunk, args.num_chunks, log)
    missing = [f"decode batch {b} context {c}" for c in args.contexts for b in args.batches
               if not any(s.batch == b and s.context == c for s in decode)]
    missing += [f"prefill chunk {c}" for c in args.chunks if not any(s.tokens == c for s in prefill)]
    if missing:  # a fit over no samples would silently be the defaults
        print(f"trillm bench profile: measured nothing for {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        out_dir = new_results_dir(args.results_dir)
        write_meta(out_dir, "bench profile", list(sys.argv[1:] if argv is None else argv), vars(args))
        path = out_dir / "profile.json"
    meta = {"model": loaded.name, "model_id": loaded.model_id, "seconds": time.perf_counter() - t0}
    fit = save_profile(path, decode, prefill, meta)
    interp = load_perf_model(path, "interpolated")
    errs = [abs(relative_error(fit.decode_seconds(s.batch, s.batch * s.context), s.seconds)) for s in decode]
    errs += [abs(relative_error(fit.prefill_seconds(s.tokens, s.start), s.seconds)) for s in prefill]
    ierrs = [abs(relative_error(interp.step_seconds(StepShape(decode_contexts=(s.context,) * s.batch)), s.seconds))
             for s in decode]
    print(f"linear fit: {fit}")
    if errs:
        print(f"linear fit |error| over {len(errs)} samples: median {statistics.median(errs):.1%}, max {max(errs):.1%}")
    if ierrs:
        print(f"interpolated decode |error| median {statistics.median(ierrs):.1%}")
    print(f"profile: {path}  ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
