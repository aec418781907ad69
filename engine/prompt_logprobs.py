"""Prompt logprobs: each prompt token's log-probability given the tokens before it, with top alternatives.

A request asks with `SamplingParams.prompt_logprobs = k` (vLLM's name). For that request's rows of a prefill
forward the model runner keeps every position's hidden state; `scored_span` says which positions a chunk still
owes, and `score` turns them into logits a piece at a time, so at most `PIECE` positions' [PIECE, vocab] logits
exist at once whatever the chunk or prompt length. The engine gathers each chunk's values into the request's
`PromptLogprobsBuffer` across chunked prefill and delivers them all with the request's first output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import mlx.core as mx

from trillm.engine.outputs import TokenLogprob
from trillm.engine.scheduler import PrefillChunk
from trillm.engine.sequence import Sequence

PIECE = 256  # positions turned into logits at once: [256, 49152] fp32 is 48 MiB


def scored_span(chunk: PrefillChunk) -> tuple[int, int] | None:
    """The positions [a, b) of `chunk` whose logits score prompt tokens a + 1 .. b, or None.

    Position p's logits predict token p + 1, so a prompt of P tokens is scored at positions 0 .. P - 2 (the
    last prompt position predicts the first generated token). A prefill recomputed after preemption owes
    nothing: its prompt logprobs went out with its first token.
    """
    seq = chunk.seq
    if seq.params.prompt_logprobs is None or seq.num_output_tokens > 0:
        return None
    a, b = chunk.start, min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)
    return (a, b) if a < b else None


@dataclass(frozen=True, slots=True)
class ScoredSpan:
    """One chunk's prompt logprobs, read back: logprobs[i] scores prompt token start + 1 + i."""

    seq: Sequence
    start: int
    logprobs: tuple[TokenLogprob, ...]


@dataclass(slots=True)
class PendingScores:
    """One chunk's prompt logprobs, not yet evaluated."""

    seq: Sequence
    start: int
    targets: list[int]
    chosen: mx.array  # float32 [n]: each target's logprob
    rank: mx.array  # int32 [n]: 1 + how many tokens beat the target
    top_ids: mx.array | None  # int32 [n, k], best first
    top_logprobs: mx.array | None  # float32 [n, k]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.rank, self.top_ids, self.top_logprobs) if a is not None]

    def read(self) -> ScoredSpan:
        chosen = cast("list[float]", self.chosen.tolist())
        rank = cast("list[int]", self.rank.tolist())
        ids = cast("list[list[int]]", self.top_ids.tolist()) if self.top_ids is not None else None
        vals = cast("list[list[float]]", self.top_logprobs.tolist()) if self.top_logprobs is not None else None
        out = []
        for i, (t, lp, r) in enumerate(zip(self.targets, chosen, rank)):
            top = tuple(zip(ids[i], vals[i])) if ids is not None and vals is not None else ()
            out.append(TokenLogprob(t, lp, top, r))
        return ScoredSpan(self.seq, self.start, tuple(out))


def score(seq: Sequence, start: int, hidden: mx.array, to_logits: Callable[[mx.array], mx.array], *,
          piece: int = PIECE) -> PendingScores:
    """Prompt logprobs of the tokens after positions start .. start + n - 1, from their hidden states [n, D].

    to_logits maps hidden states to logits (the model's head; the identity when `hidden` already is logits).
    Only the graph is built here; the runner queues it with the step.
    """
    n = hidden.shape[0]
    k = seq.params.prompt_logprobs or 0
    targets = seq.token_ids[start + 1 : start + 1 + n]
    target_array = mx.array(targets, mx.int32)
    chosen, rank, top_ids, top_vals = [], [], [], []
    for i in range(0, n, piece):
        logits = to_logits(hidden[i : i + piece]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        own = mx.take_along_axis(logp, target_array[i : i + piece, None], axis=-1)
        chosen.append(own[:, 0])
        rank.append(1 + mx.sum(logp > own, axis=-1).astype(mx.int32))
        if k == 1:  # lm-eval's case: an argmax, not a partition
            best = mx.argmax(logp, axis=-1, keepdims=True)
            top_ids.append(best.astype(mx.int32))
            top_vals.append(mx.take_along_axis(logp, best, axis=-1))
        elif k > 1:
            part = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(logp, part, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            top_ids.append(mx.take_along_axis(part, order, axis=-1).astype(mx.int32))
            top_vals.append(mx.take_along_axis(vals, order, axis=-1))

    def joined(parts: list[mx.array]) -> mx.array:
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    return PendingScores(seq, start, targets, joined(chosen), joined(rank),
                         joined(top_ids) if top_ids else None, joined(top_vals) if top_vals else None)


class PromptLogprobsBuffer:
    """One request's prompt logprobs, gathered across its prefill chunks.

    Values are stored by position, so a prefill restarted from scratch (preempted before its first token)
    overwrites what it had, never duplicates it.
    """

    def __init__(self, num_prompt_tokens: int) -> None:
        self._values: list[TokenLogprob | None] = [None] * num_prompt_tokens
        self.delivered = False

    def add(self, span: ScoredSpan) -> None:
        first = span.start + 1
        self._values[first : first + len(span.logprobs)] = span.logprobs

    def result(self) -> tuple[TokenLogprob | None, ...]:
        """Every prompt token's logprob, None for the first; once the prompt is computed."""
        missing = [i for i, v in enumerate(self._values) if v is None and i > 0]
        assert not missing, f"prompt logprobs missing at positions {missing[:8]}"
        return tuple(self._values)
