"""Continuous-batching scheduler: decode first, then chunked prefill fills the step's token budget.

Pure Python over `Sequence`s and the `BlockManager`; it never touches tensors. Waiting sequences are served
FCFS within a priority (lower value first), and the head of the waiting queue is never overtaken: if it does
not fit, nothing behind it is admitted. When a decode needs a block and none is free, the newest running
sequence is preempted by recompute: its blocks are freed (full ones stay in the prefix cache) and it
rejoins the waiting queue ahead of every later arrival.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest, Overloaded
from trillm.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first token index to compute
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every known token is computed, so the last logits are sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)  # one token each, in one forward
    prefills: list[PrefillChunk] = field(default_factory=list)  # one forward each
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


_MIN_SHARED_PREFIX = 64  # tokens: shorter shared prefixes (a chat template's preamble) are cheaper to recompute


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # admission order; the last is the newest
        self.num_preemptions = 0

    # ---- admission ---------------------------------------------------------------------------------------
    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject up front what could never be served."""
        if num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty")
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {num_prompt_tokens} tokens, but the context length is {self.max_model_len}")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"{self.max_model_len}; lower max_tokens to at most {self.max_model_len - num_prompt_tokens}")
        need = self.block_manager.blocks_needed(num_prompt_tokens + max_tokens)
        if need > self.block_manager.num_usable_blocks:
            raise InvalidRequest(
                f"the request needs {need} KV blocks but the cache has only {self.block_manager.num_usable_blocks}")

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq.num_prompt_tokens, seq.params.max_tokens)
        if len(self.waiting) >= self.config.max_waiting:
            raise Overloaded(f"the waiting queue is full ({self.config.max_waiting} requests)")
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Drop seq from whichever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 1. Decodes: every running sequence with exactly one pending token.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_pending_tokens != 1 or budget == 0:
                continue
            while not bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.may_append(seq)
            batch.decodes.append(seq)
            budget -= 1
        batch.decodes = [s for s in batch.decodes if s.status is SequenceStatus.RUNNING]

        # 2. Continue partial prefills, oldest first.
        for seq in self.running:
            if seq.num_pending_tokens > 1 and (n := self._chunk_size(seq.num_pending_tokens, budget, batch)):
                batch.prefills.append(PrefillChunk(seq, seq.num_computed_tokens, n))
                budget -= n

        # 3. Admit waiting sequences in order; the head is never overtaken.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._chunk_size(seq.num_tokens, budget, batch) or not bm.can_allocate(seq):
                break
            if self._wait_for_shared_prefix(seq):
                break
            self.waiting.pop(0)
            bm.allocate(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self._chunk_size(seq.num_pending_tokens, budget, batch)
            batch.prefills.append(PrefillChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return batch

    def _wait_for_shared_prefix(self, seq: Sequence) -> bool:
        """Hold seq back while a running sequence computes a long prefix they share (requests arriving
        together with one system prompt): a step later it is a cache hit instead of computed twice."""
        inflight = self.block_manager.num_inflight_prefix_blocks(seq, self.running)
        if not inflight:
            return False
        shared = inflight * self.block_manager.block_size
        return shared >= max(_MIN_SHARED_PREFIX, (seq.num_tokens - seq.num_computed_tokens) // 2)

    def _chunk_size(self, pending: int, budget: int, batch: ScheduledBatch) -> int:
        if self.config.enable_chunked_prefill:
            return min(pending, budget)
        # Unchunked: a whole prompt per step, alone if it is larger than the budget.
        return pending if pending <= budget or batch.is_empty else 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    # ---- after the model ran -----------------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch) -> None:
        """Advance computed counts; publish newly full blocks to the prefix cache."""
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            self.block_manager.register_computed(seq)
        for chunk in batch.prefills:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.register_computed(chunk.seq)
