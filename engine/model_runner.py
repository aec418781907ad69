"""The only place sequences become tensors: one forward for all decodes, one per prefill chunk, then one
vectorized sample over every row that needs a token, read back with a single host sync per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from trillm.engine.attention_variants import install_attention_variants
from trillm.engine.fused_ops import fused_ops, install_fused_ops
from trillm.engine.kv_cache import BatchLayout, KVPool, install_paged_attention
from trillm.engine.outputs import TokenLogprob
from trillm.engine.paged_model import ModelHead
from trillm.engine.prompt_logprobs import PendingScores, ScoredSpan, score, scored_span
from trillm.engine.runner import Launch, RowsFn
from trillm.engine.sampler import LazySample, SampleRow, Sampler
from trillm.engine.scheduler import PrefillChunk, SampledToken, ScheduledBatch
from trillm.engine.sequence import Sequence
from trillm.engine.spec_verify import accepted_tokens, position_rows, verify_tokens
from trillm.engine.state_checkpoints import prefill_phases
from trillm.engine.state_pool import StateSlots, pads_safely, state_rows
from trillm.kernels.layout import RESERVED_BLOCK

# A forward starts computing its first layers while the rest of its graph is built, every this many RMSNorms
# (engine/fused_ops.py `_Kicks`; two a layer in most families): every 3 layers cut a 9-position verify on
# SmolLM2 from ~50 to ~42 ms and a decode step that is not launched ahead from ~28 to ~21 ms.
KICK_EVERY_NORMS = 6


@dataclass(slots=True)
class ForwardInputs:
    tokens: mx.array  # int32 [B, L], rows right-padded to the longest
    layout: BatchLayout
    last_index: mx.array  # int32 [B]: each row's last real position in tokens
    # Asked by the caller (prompt logprobs): `forward` also leaves every position's final hidden states here,
    # [B, L, D] (logits [B, L, V] for a model whose head cannot be split off; see `ModelRunner.position_logits`).
    keep_hidden: bool = False
    hidden: mx.array | None = None


def prepare_inputs(seqs: list[Sequence], starts: list[int], lengths: list[int], block_size: int,
                   tokens: mx.array | None = None, state_slots: StateSlots | None = None) -> ForwardInputs:
    """Rows of new tokens, right-padded to a common L. Padding writes its K/V to the reserved block and sits
    after every real token, so causal attention never lets a real query see it. `tokens` [B, L], when given,
    replaces the host token ids (a pipelined decode feeds the previous step's unread samples). `state_slots`
    (hybrid models): the rows' recurrent-state slots, and their real lengths, so recurrent layers mask padding."""
    L = max(lengths)
    trash = RESERVED_BLOCK * block_size
    width = max(max(len(s.block_table) for s in seqs), max(-(-(st + L) // block_size) for st in starts))
    tables, slots, host_tokens = [], [], []
    for s, st, n in zip(seqs, starts, lengths):
        tables.append(s.block_table + [RESERVED_BLOCK] * (width - len(s.block_table)))
        host_tokens.append(s.token_ids[st : st + n] + [0] * (L - n) if tokens is None else [])
        for pos in range(st, st + n):
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
        slots.extend([trash] * (L - n))
    ctx = [st + L for st in starts]
    layout = BatchLayout(
        block_tables=mx.array(tables, mx.int32),
        context_lens=mx.array(ctx, mx.int32),
        slot_mapping=mx.array(slots, mx.int32),
        offsets=mx.array(starts, mx.int32),
        max_context_len=max(ctx),
        uniform_offset=starts[0] if len(set(starts)) == 1 else None,
        num_new_tokens=L,
        states=None if state_slots is None else state_rows([state_slots.slot(s) for s in seqs], starts, lengths),
    )
    token_array = mx.array(host_tokens, mx.int32) if tokens is None else tokens
    return ForwardInputs(token_array, layout, mx.array([n - 1 for n in lengths], mx.int32))


def group_chunks(chunks: list[PrefillChunk], max_waste: float = 1.5) -> list[list[PrefillChunk]]:
    """Batch prefill chunks of similar length into one forward each, padding at most max_waste x the work."""
    groups: list[list[PrefillChunk]] = []
    real = 0
    for c in sorted(chunks, key=lambda c: -c.num_tokens):
        if groups and (len(groups[-1]) + 1) * groups[-1][0].num_tokens <= max_waste * (real + c.num_tokens):
            groups[-1].append(c)
            real += c.num_tokens
        else:
            groups.append([c])
            real = c.num_tokens
    return groups


class ModelRunner:
    """The MLX runner: the model over the paged pool, then the vectorized sampler."""

    supports_launch_ahead = True
    supports_speculation = True  # verifies ScheduledBatch.drafts (a runner without it is never given any)

    def __init__(self, model: nn.Module, pool: KVPool, sampler: Sampler) -> None:
        self.model = model
        self.pool = pool
        self.caches = pool.caches()
        self.sampler = sampler
        self.patched_modules = install_paged_attention(model)
        self.attention_variants = install_attention_variants(model)  # layers that write their scores out
        self.fused_ops = install_fused_ops(model)  # linear, RMSNorm, RoPE, SwiGLU through trillm.kernels
        self.head = ModelHead(model)  # the model's own tail, on the last positions only
        self.state_slots = pool.states.slots if pool.states is not None else None  # hybrid models' recurrent state
        # Ragged prefill rows are right-padded; a model whose recurrent layers do not mask padding gets chunks of
        # one length per forward (engine/state_pool.py).
        self.max_waste = 1.5 if self.state_slots is None or pads_safely(model) else 1.0
        self.checkpoints = self.state_slots.checkpoints if self.state_slots is not None else None
        self.kick_every = KICK_EVERY_NORMS  # 0: build the whole graph first (bench profile-ops times building alone)

    def prepare_decode(self, seqs: list[Sequence], tokens: mx.array | None = None) -> ForwardInputs:
        # tokens: [B, 1], each row's one pending token (from the host, or the previous step's lazy samples).
        # The step is already committed, so each row's new token sits at num_computed_tokens - 1.
        return prepare_inputs(seqs, [s.num_computed_tokens - 1 for s in seqs], [1] * len(seqs),
                              self.pool.block_size, None if tokens is None else tokens.reshape(-1, 1).astype(mx.int32),
                              self.state_slots)

    def prepare_prefill(self, chunks: list[PrefillChunk]) -> ForwardInputs:
        # tokens: [B, L], one chunk per row
        return prepare_inputs([c.seq for c in chunks], [c.start for c in chunks], [c.num_tokens for c in chunks],
                              self.pool.block_size, state_slots=self.state_slots)

    def prepare_verify(self, seqs: list[Sequence], drafts: dict[str, list[int]]) -> tuple[ForwardInputs, list[int]]:
        # tokens: [B, 1 + max k], each row's pending token (at num_computed_tokens - 1) and its proposal, if any.
        host, lengths = verify_tokens(seqs, drafts)
        inputs = prepare_inputs(seqs, [s.num_computed_tokens - 1 for s in seqs], lengths, self.pool.block_size,
                                mx.array(host, mx.int32), self.state_slots)
        return inputs, lengths

    def verify_logits(self, inputs: ForwardInputs, lengths: list[int]) -> mx.array:
        """Logits [sum(lengths), V] of every real position, row by row: the model's tail once over the kept hidden
        states (the forward's own last-position logits are never evaluated, so the head's weights are read once)."""
        inputs.keep_hidden = True
        self.forward(inputs)
        assert inputs.hidden is not None
        B, L = inputs.tokens.shape
        real = mx.array([i * L + j for i, n in enumerate(lengths) for j in range(n)])
        return self.position_logits(inputs.hidden.reshape(B * L, inputs.hidden.shape[-1])[real][None])[0]

    def forward(self, inputs: ForwardInputs) -> mx.array:
        """Logits [B, V] at each row's last real position (and, if asked, `inputs.hidden`)."""
        self.pool.begin(inputs.layout)
        with fused_ops(self.pool.kernels, kick_every=self.kick_every):
            try:
                logits, hidden = self.head.forward(inputs.tokens, self.caches, inputs.last_index)
                self.pool.commit()  # a forward that raised leaves every recurrent state as it was
                if inputs.keep_hidden:
                    inputs.hidden = hidden
                return logits
            finally:
                self.pool.end()

    def position_logits(self, hidden: mx.array) -> mx.array:
        """Logits of hidden states that `forward` left in `ForwardInputs.hidden`: the model's own tail, through
        the same kernels as the forward (outside them a quantized head runs MLX's own quantized matmul, ~20x
        slower per row on CPU)."""
        with fused_ops(self.pool.kernels):
            return self.head.logits(hidden)

    def launch(self, batch: ScheduledBatch, rows: RowsFn, check_abort: Callable[[], None] | None = None, *,
               after: Launch | None = None) -> Launch:
        """Queue every forward of the step and its sampling with `mx.async_eval`; read nothing back.

        after: the previous, unread step; each decode row is fed the token it sampled there.
        """
        logits: list[mx.array] = []
        sampled: list[Sequence] = []
        spec_rows: list[SampleRow] = []  # the speculating decode step's rows, one per position (engine/spec_verify.py)
        if batch.drafts:
            assert after is None, "a speculating step is never launched ahead"
            inputs, lengths = self.prepare_verify(batch.decodes, batch.drafts)
            out = self.verify_logits(inputs, lengths)
            mx.async_eval(out, *self.pool.arrays())
            logits.append(out)
            for s in batch.decodes:
                draft = batch.drafts.get(s.request_id, [])
                spec_rows += position_rows(rows(s), draft)
                sampled += [s] * (1 + len(draft))
        elif batch.decodes:
            tokens = None
            if after is not None:
                assert isinstance(after.pending, LazySample)
                index = {id(s): i for i, s in enumerate(after.seqs)}
                picked = [index[id(s)] for s in batch.decodes]
                tokens = after.pending.tokens
                if picked != list(range(len(after.seqs))):
                    tokens = tokens[mx.array(picked)]
            out = self.forward(self.prepare_decode(batch.decodes, tokens))
            mx.async_eval(out, *self.pool.arrays())
            logits.append(out)
            sampled += batch.decodes
        scores: list[PendingScores] = []
        # A hybrid model's chunks are cut at recurrent-state checkpoint boundaries (engine/state_checkpoints.py).
        phases = prefill_phases(batch.prefills, self.checkpoints, lambda c, start, n: PrefillChunk(c.seq, start, n))
        for group in (g for phase in phases for g in group_chunks(phase, self.max_waste)):
            if check_abort is not None:
                check_abort()
            inputs = self.prepare_prefill(group)
            spans = [(row, c, span) for row, c in enumerate(group) if (span := scored_span(c)) is not None]
            inputs.keep_hidden = bool(spans)
            out = self.forward(inputs)
            chunk_scores = []
            for row, c, (a, b) in spans:
                assert inputs.hidden is not None
                chunk_scores.append(score(c.seq, a, inputs.hidden[row, a - c.start : b - c.start],
                                          self.position_logits))
            scores += chunk_scores
            keep = [i for i, c in enumerate(group) if c.samples]
            queued = [a for s in chunk_scores for a in s.arrays()] + self.pool.arrays()
            if keep:
                out = out[mx.array(keep)] if len(keep) < len(group) else out
                logits.append(out)
                sampled += [group[i].seq for i in keep]
                mx.async_eval(out, *queued)
            else:
                mx.async_eval(*queued)
        if not sampled:
            return Launch(batch, [], None, prompt_logprobs=scores or None)
        lazy = self.sampler.sample(mx.concatenate(logits, axis=0),
                                   spec_rows + [rows(s) for s in sampled[len(spec_rows) :]])
        mx.async_eval(*lazy.arrays())
        return Launch(batch, sampled, lazy, prompt_logprobs=scores or None)

    def collect(self, launch: Launch) -> list[SampledToken]:
        """Wait for a launched step (the one host sync) and read its samples."""
        if not isinstance(launch.pending, LazySample):
            mx.eval(*self.pool.arrays())
            return []
        result = self.sampler.read(launch.pending)
        out = []
        for i, s in enumerate(launch.seqs):
            lp = None
            p = s.params
            chosen = result.logprobs[i] if result.logprobs is not None else None
            if chosen is not None and (p.logprobs or p.top_logprobs):
                top = tuple(result.top_logprobs[i]) if result.top_logprobs else ()
                lp = TokenLogprob(result.token_ids[i], chosen, top)
            out.append(SampledToken(s, result.token_ids[i], lp))
        return accepted_tokens(out, launch.batch.drafts) if launch.batch.drafts else out

    def collect_prompt_logprobs(self, launch: Launch) -> list[ScoredSpan]:
        """Read the step's prompt logprobs (queued with it, so `collect` has already waited for them)."""
        if launch.prompt_logprobs is None:
            return []
        return [p.read() for p in cast("list[PendingScores]", launch.prompt_logprobs)]
