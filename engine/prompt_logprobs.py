"""Prompt logprobs: each prompt token's log-probability given the tokens before it, with top alternatives.

A request asks with `SamplingParams.prompt_logprobs = k` (vLLM's name). For that request's rows of a prefill
forward the model runner keeps every position's hidden state; `scored_span` says which positions a chunk still
owes, and `PendingScores.read` turns them into logits a piece at a time, so at most two pieces' [PIECE, vocab]
logits exist at once whatever the chunk or prompt length. The engine gathers each chunk's values into the
request's `PromptLogprobsBuffer` across chunked prefill and delivers them all with the request's first output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import mlx.core as mx
import numpy as np

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
    """One chunk's prompt logprobs, before they are read: the scored positions' hidden states (queued with the
    step) and how to turn them into logits."""

    seq: Sequence
    start: int
    hidden: mx.array  # [n, D]: positions start .. start + n - 1
    to_logits: Callable[[mx.array], mx.array]
    piece: int = PIECE

    def arrays(self) -> list[mx.array]:
        return [self.hidden]

    def read(self) -> ScoredSpan:
        """Logits a piece at a time (the next piece's head runs while this one is reduced), each reduced on the
        host: numpy's vectorized exp is an order of magnitude faster than MLX's on CPU, where it dominates."""
        n, k = self.hidden.shape[0], self.seq.params.prompt_logprobs or 0
        targets = self.seq.token_ids[self.start + 1 : self.start + 1 + n]
        bounds = list(range(0, n, self.piece))
        pieces = [self.to_logits(self.hidden[i : i + self.piece]).astype(mx.float32) for i in bounds]
        out: list[TokenLogprob] = []
        scratch: np.ndarray | None = None
        mx.async_eval(pieces[0])
        for j, (i, logits) in enumerate(zip(bounds, pieces)):
            if j + 1 < len(pieces):
                mx.async_eval(pieces[j + 1])
            host = np.asarray(logits)
            if scratch is None:
                scratch = np.empty_like(host)
            out += _reduce(host, targets[i : i + self.piece], k, scratch)
            pieces[j] = mx.array(0)  # let the piece's logits go
        return ScoredSpan(self.seq, self.start, tuple(out))


def _reduce(logits: np.ndarray, targets: list[int], k: int, scratch: np.ndarray) -> list[TokenLogprob]:
    """Each row's target logprob and rank, and its top k: log-softmax without writing it out (scratch: a
    buffer at least as large as logits, reused across pieces)."""
    rows = np.arange(len(targets))
    best = logits.argmax(axis=1)
    peak = logits[rows, best][:, None]
    shifted = scratch[: logits.shape[0]]
    np.subtract(logits, peak, out=shifted)
    np.exp(shifted, out=shifted)
    lse = peak[:, 0] + np.log(shifted.sum(axis=1))
    own = logits[rows, targets]
    rank = 1 + np.count_nonzero(logits > own[:, None], axis=1)
    chosen = own - lse
    if k == 1:  # lm-eval's case: the argmax, no partition
        ids = best[:, None]
    elif k > 1:
        ids = _top_k(logits, k)
        ids = np.take_along_axis(ids, np.argsort(-np.take_along_axis(logits, ids, axis=1), axis=1), axis=1)
    else:
        ids = np.zeros((len(targets), 0), np.int64)
    # The same logits minus the same lse: a target that is the argmax gets exactly its top-1 value.
    values = np.take_along_axis(logits, ids, axis=1) - lse[:, None]
    return [TokenLogprob(t, float(c), tuple(zip(i.tolist(), v.tolist())), int(r))
            for t, c, r, i, v in zip(targets, chosen, rank, ids, values)]


_BLOCK = 256


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of each row's k largest logits (unordered): an argpartition over the k blocks of _BLOCK logits
    with the largest maxima, which hold them all (a block holding one of the top k has a maximum no smaller
    than it, and fewer than k blocks can beat that). 10x cheaper than partitioning the whole vocabulary."""
    m, V = logits.shape
    nb = V // _BLOCK
    if nb <= k:
        return np.argpartition(logits, -k, axis=1)[:, -k:]
    blocks = logits[:, : nb * _BLOCK].reshape(m, nb, _BLOCK)
    chosen = np.argpartition(blocks.max(axis=2), -k, axis=1)[:, -k:]  # [m, k] block indices
    values = np.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(m, k * _BLOCK)
    ids = (chosen[:, :, None] * _BLOCK + np.arange(_BLOCK)).reshape(m, k * _BLOCK)
    if nb * _BLOCK < V:  # the ragged tail is always a candidate
        values = np.concatenate([values, logits[:, nb * _BLOCK :]], axis=1)
        ids = np.concatenate([ids, np.broadcast_to(np.arange(nb * _BLOCK, V), (m, V - nb * _BLOCK))], axis=1)
    return np.take_along_axis(ids, np.argpartition(values, -k, axis=1)[:, -k:], axis=1)


def score(seq: Sequence, start: int, hidden: mx.array, to_logits: Callable[[mx.array], mx.array], *,
          piece: int = PIECE) -> PendingScores:
    """Prompt logprobs of the tokens after positions start .. start + n - 1, from their hidden states [n, D].

    to_logits maps hidden states to logits (the model's head; the identity when `hidden` already is logits).
    Only the hidden states join the step's graph; the head runs when the scores are read.
    """
    return PendingScores(seq, start, hidden, to_logits, piece)


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
