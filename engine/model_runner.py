"""The only place sequences become tensors: one forward for all decodes, one per prefill chunk, then one
vectorized sample over every row that needs a token, read back with a single host sync per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from trillm.engine.kv_cache import BatchLayout, KVPool, install_paged_attention
from trillm.engine.sampler import SampleResult, Sampler, SampleRow
from trillm.engine.scheduler import ScheduledBatch
from trillm.engine.sequence import Sequence
from trillm.kernels.layout import RESERVED_BLOCK


@dataclass(slots=True)
class ForwardInputs:
    tokens: mx.array  # int32 [B, L]
    layout: BatchLayout


def _layout(seqs: list[Sequence], starts: list[int], num_new: int, block_size: int) -> BatchLayout:
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [RESERVED_BLOCK] * (max_blocks - len(s.block_table)) for s in seqs]
    slots = []
    for s, start in zip(seqs, starts):
        for pos in range(start, start + num_new):
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
    ctx = [start + num_new for start in starts]
    return BatchLayout(
        block_tables=mx.array(tables, mx.int32),
        context_lens=mx.array(ctx, mx.int32),
        slot_mapping=mx.array(slots, mx.int32),
        offsets=mx.array(starts, mx.int32),
        max_context_len=max(ctx),
        num_new_tokens=num_new,
    )


SampledToken = tuple[Sequence, int, SampleResult, int]  # (seq, token id, the batch's result, its row there)


class Runner(Protocol):
    """What LLMEngine needs from a runner: run one scheduled step, return a token per sampled sequence."""

    def run(self, batch: ScheduledBatch, rows: Callable[[Sequence], SampleRow],
            check_abort: Callable[[], None] | None = None) -> list[SampledToken]: ...


class ModelRunner:
    def __init__(self, model: nn.Module, pool: KVPool, sampler: Sampler) -> None:
        self.model = model
        self.pool = pool
        self.caches = pool.caches()
        self.sampler = sampler
        self.patched_modules = install_paged_attention(model)
        self._inner = getattr(model, "model", None)  # mlx-lm's decoder stack, for last-position-only logits

    def prepare_decode(self, seqs: list[Sequence]) -> ForwardInputs:
        # tokens: [B, 1], each row's one pending token
        starts = [s.num_computed_tokens for s in seqs]
        tokens = mx.array([[s.token_ids[p]] for s, p in zip(seqs, starts)], mx.int32)
        return ForwardInputs(tokens, _layout(seqs, starts, 1, self.pool.block_size))

    def prepare_prefill(self, seq: Sequence, start: int, num_tokens: int) -> ForwardInputs:
        # tokens: [1, L], one chunk of one sequence
        tokens = mx.array([seq.token_ids[start : start + num_tokens]], mx.int32)
        return ForwardInputs(tokens, _layout([seq], [start], num_tokens, self.pool.block_size))

    def forward(self, inputs: ForwardInputs, *, last_only: bool) -> mx.array:
        """Logits [B, V] of each row's last position (or [B, L, V] when last_only is False)."""
        self.pool.layout = inputs.layout
        try:
            if last_only and self._can_split_head():
                h = self._inner(inputs.tokens, cache=self.caches)
                return self._head(h[:, -1, :])
            logits = self.model(inputs.tokens, cache=self.caches)
            return logits[:, -1, :] if last_only else logits
        finally:
            self.pool.layout = None

    def _can_split_head(self) -> bool:
        return self._inner is not None and (hasattr(self.model, "lm_head") or hasattr(self._inner, "embed_tokens"))

    def _head(self, h: mx.array) -> mx.array:
        # mlx-lm applies lm_head to every position; a prefill chunk only needs the last one.
        if hasattr(self.model, "lm_head"):
            return self.model.lm_head(h)
        return self._inner.embed_tokens.as_linear(h)

    def run(self, batch: ScheduledBatch, rows: Callable[[Sequence], SampleRow],
            check_abort: Callable[[], None] | None = None) -> list[SampledToken]:
        """Run every forward of the step and sample. Returns (seq, token, result, row index) per sampled seq."""
        logits: list[mx.array] = []
        sampled: list[Sequence] = []
        if batch.decodes:
            out = self.forward(self.prepare_decode(batch.decodes), last_only=True)
            mx.async_eval(out, *self.pool.arrays())
            logits.append(out)
            sampled += batch.decodes
        for chunk in batch.prefills:
            if check_abort is not None:
                check_abort()
            out = self.forward(self.prepare_prefill(chunk.seq, chunk.start, chunk.num_tokens), last_only=True)
            if chunk.completes_prompt:
                logits.append(out)
                sampled.append(chunk.seq)
                mx.async_eval(out, *self.pool.arrays())
            else:
                mx.async_eval(*self.pool.arrays())
        if not sampled:
            mx.eval(*self.pool.arrays())
            return []
        result = self.sampler(mx.concatenate(logits, axis=0), [rows(s) for s in sampled])
        return [(s, result.token_ids[i], result, i) for i, s in enumerate(sampled)]
