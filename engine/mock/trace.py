"""Request traces, mooncake style: one JSON object per line, timestamps in milliseconds.

    {"timestamp": 0, "input_length": 1200, "output_length": 64, "hash_ids": [0, 1, 7]}

hash_ids name the prompt's blocks of `block_tokens` tokens (512 in mooncake's traces): requests that share a
leading run of hash ids share that prompt prefix, so the prefix cache sees what the trace's users shared.
`prompt_tokens` turns an entry into token ids deterministically; `synthetic_trace` generates traces.

Run `python -m trillm.engine.mock --help` to write one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from trillm.engine.mock.runner import splitmix64
from trillm.engine.mock.tokenizer import NUM_SPECIAL

DEFAULT_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float  # ms from the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.input_length < 1 or self.output_length < 1 or self.timestamp < 0:
            raise ValueError(f"bad trace entry {self}: lengths must be >= 1 and the timestamp >= 0")

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["hash_ids"] = list(self.hash_ids)
        return d


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace (blank lines skipped), sorted by timestamp."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(TraceRequest(float(d.get("timestamp", 0)), int(d["input_length"]), int(d["output_length"]),
                                    tuple(int(h) for h in d.get("hash_ids", ()))))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a trace entry: {exc}") from exc
    out.sort(key=lambda r: r.timestamp)
    return out


def save_trace(path: str | Path, trace: Iterable[TraceRequest]) -> None:
    Path(path).write_text("".join(json.dumps(r.to_json()) + "\n" for r in trace))


def _block(seed: int, key: int, n: int, vocab_size: int) -> list[int]:
    base = splitmix64(seed * 0x100000001B3 + key)
    span = vocab_size - NUM_SPECIAL
    return [NUM_SPECIAL + splitmix64(base + i) % span for i in range(n)]


def prompt_tokens(req: TraceRequest, index: int, *, vocab_size: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                  seed: int = 0) -> list[int]:
    """input_length token ids: the hash ids' blocks, then tokens unique to request `index`."""
    out: list[int] = []
    for h in req.hash_ids:
        if len(out) >= req.input_length:
            break
        out += _block(seed, h, block_tokens, vocab_size)
    del out[req.input_length:]
    if len(out) < req.input_length:
        out += _block(seed + 1, index, req.input_length - len(out), vocab_size)
    return out


def synthetic_trace(
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    rate: float = 1.0,
    burstiness: float = 1.0,
    input_len: int = 512,
    output_len: int = 128,
    range_ratio: float = 0.5,
    num_prefixes: int = 8,
    prefix_blocks: int = 1,
    prefix_share: float = 0.5,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    seed: int = 0,
) -> list[TraceRequest]:
    """Gamma arrivals at `rate` req/s (burstiness 1 = Poisson); lengths uniform in len * (1 +- range_ratio).

    A `prefix_share` of requests start with one of `num_prefixes` shared prefixes of `prefix_blocks` blocks,
    chosen Zipf-like (prefix k with weight 1/(k+1)), like a few popular system prompts.
    """
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests or duration_s")
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(max(1, num_prefixes))]
    next_unique = 1_000_000  # hash ids above this are unique to one request
    t = 0.0
    out: list[TraceRequest] = []
    while (num_requests is None or len(out) < num_requests) and (duration_s is None or t < duration_s):
        isl = max(1, round(input_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        osl = max(1, round(output_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        blocks = math.ceil(isl / block_tokens)
        ids: list[int] = []
        if num_prefixes and rng.random() < prefix_share:
            k = rng.choices(range(len(weights)), weights)[0]
            ids = [k * 1000 + j for j in range(min(prefix_blocks, blocks))]
        while len(ids) < blocks:
            ids.append(next_unique)
            next_unique += 1
        out.append(TraceRequest(round(t * 1000, 3), isl, osl, tuple(ids)))
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def multi_turn_trace(
    *,
    num_conversations: int,
    num_turns: int,
    turn_tokens: int,
    output_len: int,
    system_tokens: int = 0,
    turn_gap_s: float = 2.0,
    stagger_s: float = 0.25,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    seed: int = 0,
) -> list[TraceRequest]:
    """Chat sessions whose turn t resends the whole conversation so far: each prompt is the previous one plus
    `turn_tokens` (the previous answer and the next question), in whole blocks, so it extends the previous
    prompt's prefix exactly. Conversation c starts at c * stagger_s; the gaps between its turns (the user's
    think time) are uniform in turn_gap_s * [0.5, 1.5]."""
    rng = random.Random(seed)
    if min(num_conversations, num_turns, turn_tokens, output_len, block_tokens) < 1 or system_tokens < 0:
        raise ValueError("counts and lengths must be >= 1 (system_tokens >= 0)")
    per_turn = math.ceil(turn_tokens / block_tokens)
    system = math.ceil(system_tokens / block_tokens)
    out = []
    for c in range(num_conversations):
        base = 2_000_000 + c * 100_000  # this conversation's own blocks
        at = c * stagger_s
        for t in range(num_turns):
            blocks = system + (t + 1) * per_turn
            out.append(TraceRequest(round(at * 1000, 3), blocks * block_tokens, output_len,
                                    tuple(base + j for j in range(blocks))))
            at += turn_gap_s * rng.uniform(0.5, 1.5)
    out.sort(key=lambda r: r.timestamp)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trillm.engine.mock", description="write a synthetic trace")
    p.add_argument("out", help="JSONL file to write")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="seconds of traffic (instead of a count)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-blocks", type=int, default=1)
    p.add_argument("--prefix-share", type=float, default=0.5)
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.num_requests is None and a.duration is None:
        a.num_requests = 100
    trace = synthetic_trace(
        num_requests=a.num_requests, duration_s=a.duration, rate=a.rate, burstiness=a.burstiness,
        input_len=a.input_len, output_len=a.output_len, range_ratio=a.range_ratio, num_prefixes=a.num_prefixes,
        prefix_blocks=a.prefix_blocks, prefix_share=a.prefix_share, block_tokens=a.block_tokens, seed=a.seed,
    )
    save_trace(a.out, trace)
    print(f"wrote {len(trace)} requests over {trace[-1].timestamp / 1000 if trace else 0:.1f} s to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
