"""Continuous-batching scheduler: decode first, then chunked prefill fills the step's token budget.

Pure Python over `Sequence`s and the `BlockManager`; it never touches tensors. Waiting sequences are served
in fair-queueing order within a priority (lower value first), and the head of the waiting queue is never
overtaken: if it does not fit, nothing behind it is admitted. When a decode needs a block and none is free,
the newest running sequence is preempted by recompute: its blocks are freed (full ones stay in the prefix
cache) and it rejoins the waiting queue ahead of every later arrival.

Fairness between client requests (start-time fair queueing over groups, as in network schedulers): the
sequences of one request (its prompts x n) share a group, and each sequence gets a tag, its group's previous
tag + 1, but never less than the virtual time (the largest tag admitted) + 1. Waiting sequences are ordered by
(priority, tag, arrival), so a request's 2nd, 3rd, ... sequences queue behind other requests' 1st: admission
is round-robin over the requests waiting, and a request arriving behind a 1,000-sequence one is admitted
within one sequence of it. Ungrouped sequences (every tag the virtual time + 1) stay first-come first-served.
Two bounds keep one request from crowding out the others: its share of the waiting queue
(`RequestLimits.max_group_waiting`, refused with InvalidRequest) and of the running batch. Alone, a request
may use every row; beside others each group's share is its max-min fair share of the rows (`_fair_shares`:
who wants less than an equal split gets what it wants, the rest split the remainder), and never more than an
equal split, ceil(rows / live groups), even while rows are free: a step's time grows with its rows (on a CPU
about linearly), so a free row given to a large request is paid for by every other request's inter-token gap
and first token. A waiting sequence of a group at its share is passed over (the only way the head is
overtaken), and one under its share that finds every row taken preempts the newest running sequence of the
group furthest over its share (by recompute, as for a lack of blocks; its full blocks stay in the prefix
cache): another request's first sequence gets a row in the step after it arrives, and the large request
keeps its share, so it still progresses. A group left over its share when others arrive is not preempted for
that alone: it shrinks as its sequences finish, or as newcomers need its rows.

Scheduling policy (`EngineConfig.scheduling_policy`, vLLM's names): under "fcfs" a request's `priority` is
ignored (the order above). Under "priority" lower values go first, aged so that nothing starves: priority p
is folded into the tag as a head start of p x `priority_aging` rounds of virtual time (a round: the virtual
time moving on by one as tags are admitted), so a class-p sequence is overtaken only by sequences arriving
within that many rounds after it; the waiting queue is bounded, so each round is finite and its wait is too.
The order stays a static key (the waiting list stays sorted; the fair queueing between groups is unchanged
within a class). `priority_aging`
0 is strict priority: (priority, tag, arrival), which lets a stream of class-0 work starve the rest.

One step's flow (nano-vllm's, with vLLM v1's accounting):
- `schedule()` picks the step and commits to it: each scheduled token counts as computed from here on
  (`num_computed_tokens` advances), because the runner launches the step right away.
- `schedule_ahead(batch)` decides whether the next decode step can be launched before this one is read back.
- `postprocess(batch, sampled)` runs once the step's tokens are known: it appends them, publishes newly full
  blocks to the prefix cache, detects finishes (stop token ids, EOS, max_tokens, the context limit) and frees
  finished sequences. `finish_scored(batch)` then ends those that generate nothing (max_tokens 0).
  `finish(seq)` does the same for finishes decided elsewhere (stop strings, aborts).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from trillm.engine.admission import RequestLimits
from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest, Overloaded
from trillm.engine.outputs import FinishReason, TokenLogprob
from trillm.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first token index computed by this chunk
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every known token is computed."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """Its last logits are sampled: it completes the prompt of a request that generates (max_tokens > 0)."""
        return self.completes_prompt and self.seq.params.max_tokens > 0


@dataclass(slots=True)
class ScheduledBatch:
    # One token each, in one forward; a decode's new token sits at position num_computed_tokens - 1.
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)  # batched into forwards by similar length
    preempted: list[Sequence] = field(default_factory=list)
    # Speculating decodes' proposed tokens, by request id (engine/spec_decode.py): each such row runs its pending
    # token and these through the decode forward, one position each.
    drafts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a token from this step, in the runner's row order: decodes first."""
        return self.decodes + [c.seq for c in self.prefills if c.samples]


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sequence's token from a step, as the runner read it back."""

    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None = None  # only when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None  # GRAMMAR: why the grammar could not go on
    token_is_text: bool = False  # the finishing token is part of the output (a grammar completed by it)


_MIN_SHARED_PREFIX = 64  # tokens: shorter shared prefixes (a chat template's preamble) are cheaper to recompute


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, limits: RequestLimits,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.block_manager = block_manager
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # admission order; the last is the newest
        self.num_preemptions = 0
        self._vtime = 0  # fair queueing's virtual time: the largest tag admitted so far
        self._last_tag: dict[str, int] = {}  # per live group, its newest sequence's tag
        self._group_waiting: Counter[str] = Counter()
        self._group_running: Counter[str] = Counter()

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def _fair_shares(self) -> dict[str, int]:
        """Each live group's share of the running rows that ungrouped sequences leave, or {} for a group alone.

        A group's demand (its running + waiting sequences) counts up to an equal split of the rows, ceil(rows /
        live groups); if those demands fit, each is its share. Else water-filling (max-min fairness): groups
        wanting less than an equal split get what they want, the rest split what is left; its remainder goes
        to the groups holding the most rows now (then in queue order), so that a share never moves a row for
        nothing.
        """
        if len(self._group_waiting) < 2:
            return {}
        rows = self.config.max_num_seqs - sum(s.group is None for s in self.running)
        split = -(-max(rows, 0) // len(self._group_waiting))
        # in arrival order
        demand = {g: min(n + self._group_running[g], split) for g, n in self._group_waiting.items()}
        if sum(demand.values()) <= rows:
            return demand
        shares: dict[str, int] = {}
        left = max(rows, 0)
        by_demand = sorted(demand, key=demand.__getitem__)
        for k, g in enumerate(by_demand):
            if demand[g] * (len(by_demand) - k) > left:
                break
            shares[g] = demand[g]
            left -= demand[g]
        rest = [g for g in demand if g not in shares]
        level, extra = divmod(left, len(rest))
        if extra:
            first: dict[str, int] = {}  # each group's place in the queue
            for pos, s in enumerate(self.waiting):
                if s.group is not None:
                    first.setdefault(s.group, pos)
            rest.sort(key=lambda g: (-self._group_running[g], first.get(g, len(self.waiting))))
        for k, g in enumerate(rest):
            shares[g] = level + (k < extra)
        return shares

    def _fair_share_victim(self, seq: Sequence, shares: dict[str, int]) -> Sequence | None:
        """The row seq (a grouped sequence under its share) takes when none is free: the newest running
        sequence of the group furthest over its share, unless that one is more urgent; None if no group is over."""
        if seq.group is None:
            return None
        over = {g: self._group_running[g] - share for g, share in shares.items() if self._group_running[g] > share}
        if not over:
            return None
        worst = max(over, key=lambda g: (over[g], self._group_running[g]))
        return next((s for s in reversed(self.running) if s.group == worst and s.rank >= seq.rank), None)

    # ---- admission ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.limits.check(seq.num_prompt_tokens, seq.params)
        if len(self.waiting) >= self.config.max_waiting:
            raise Overloaded(f"the waiting queue is full ({self.config.max_waiting} requests)")
        g = seq.group
        if g is None:
            start = self._vtime + 1
        else:
            if self._group_waiting[g] >= self.limits.max_group_waiting:
                raise InvalidRequest(
                    f"one request may queue at most {self.limits.max_group_waiting} generations (prompts x n; a "
                    f"quarter of --max-waiting {self.limits.max_waiting})")
            start = max(self._vtime, self._last_tag.get(g, 0)) + 1
            self._last_tag[g] = start  # before the priority's head start: that is counted once, not per sequence
            self._group_waiting[g] += 1
        seq.rank, seq.tag = self._rank_and_tag(seq.priority, start)
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def _rank_and_tag(self, priority: int, start: int) -> tuple[int, int]:
        """A new sequence's place under the scheduling policy (see the module docstring)."""
        if self.config.scheduling_policy == "fcfs":
            return 0, start
        if self.config.priority_aging == 0:
            return priority, start
        return 0, start + priority * self.config.priority_aging

    def finish(self, seq: Sequence) -> None:
        """Drop seq from whichever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
            self._count_group(seq, running=-1)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._count_group(seq, waiting=-1)
        seq.status = SequenceStatus.FINISHED

    def _count_group(self, seq: Sequence, *, waiting: int = 0, running: int = 0) -> None:
        g = seq.group
        if g is None:
            return
        self._group_waiting[g] += waiting
        self._group_running[g] += running
        if self._group_waiting[g] <= 0 and self._group_running[g] <= 0:  # the group is gone: forget it
            del self._group_waiting[g], self._group_running[g]
            self._last_tag.pop(g, None)

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
            if seq.is_finished or seq in batch.preempted:
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

        # 3. Admit waiting sequences in order; the head is never overtaken, but a sequence whose group holds
        # its fair share of the running batch is passed over (the row is for the other requests). A sequence
        # under its share that finds every row taken takes one from the group furthest over its share.
        i = 0
        shares = self._fair_shares() if self.waiting else {}
        while i < len(self.waiting):
            seq = self.waiting[i]
            if seq.group is not None and seq.group in shares and self._group_running[seq.group] >= shares[seq.group]:
                i += 1
                continue
            if len(self.running) >= self.config.max_num_seqs:
                if (yielder := self._fair_share_victim(seq, shares)) is None:
                    break
                self._preempt(yielder)
                batch.preempted.append(yielder)
                budget += self._unschedule(batch, yielder)
                i = self.waiting.index(seq)  # the preempted one rejoined the queue, maybe ahead of seq
            if budget == 0 or not self._chunk_size(seq.num_tokens, budget, batch) or not bm.can_allocate(seq):
                break
            if self._wait_for_shared_prefix(seq):
                break
            self.waiting.pop(i)
            self._vtime = max(self._vtime, seq.tag)
            self._count_group(seq, waiting=-1, running=1)
            bm.allocate(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self._chunk_size(seq.num_pending_tokens, budget, batch)
            batch.prefills.append(PrefillChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        self._commit(batch)
        return batch

    def schedule_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The next decode step of `batch`'s sequences, to launch before `batch` is read back; or None.

        Only when nothing else could want the step (no prefill, every running sequence decoding, nobody waiting
        but sequences passed over for their request's share: a fan-out's queue beside other requests must not
        cost them the launch-ahead), and only for sequences whose next step does not depend on the unread token
        (penalties count it), that have no grammar (its mask for the next step depends on this step's token) and
        that cannot finish by length on this step's token.
        """
        if batch.prefills or not batch.decodes or len(self.running) != len(batch.decodes) or self._may_admit():
            return None
        # A constrained row's next mask needs this step's token (see LLMEngine.step).
        if any(s.status is not SequenceStatus.RUNNING or s.params.needs_penalties or s.grammar is not None
               for s in batch.decodes):
            return None
        # This step's token is output number num_output_tokens + 1; length-finished sequences stop there.
        seqs = [s for s in batch.decodes
                if s.num_output_tokens + 1 < s.params.max_tokens and s.num_tokens + 1 < self.max_model_len]
        if not seqs:
            return None
        bm = self.block_manager
        if sum(bm.blocks_needed(s.num_computed_tokens + 1) - len(s.block_table) for s in seqs) > bm.num_free_blocks:
            return None
        for s in seqs:
            bm.may_append(s)
        ahead = ScheduledBatch(decodes=seqs)
        self._commit(ahead)
        return ahead

    def _may_admit(self) -> bool:
        """Some waiting sequence is not passed over for its request's share (the next schedule() may admit it)."""
        if not self.waiting:
            return False
        shares = self._fair_shares()
        return any(s.group is None or s.group not in shares or self._group_running[s.group] < shares[s.group]
                   for s in self.waiting)

    def _commit(self, batch: ScheduledBatch) -> None:
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for chunk in batch.prefills:
            chunk.seq.num_computed_tokens += chunk.num_tokens

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
        self._count_group(seq, waiting=1, running=-1)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    @staticmethod
    def _unschedule(batch: ScheduledBatch, seq: Sequence) -> int:
        """Take a sequence preempted after it was scheduled out of `batch`; returns the tokens it had there."""
        if seq in batch.decodes:
            batch.decodes.remove(seq)
            return 1
        for chunk in batch.prefills:
            if chunk.seq is seq:
                batch.prefills.remove(chunk)
                return chunk.num_tokens
        return 0

    # ---- after the model ran -----------------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch,
                    sampled: list[SampledToken]) -> list[tuple[SampledToken, Finish | None]]:
        """Append the step's tokens, publish full blocks, detect token-level finishes and free those.

        Tokens of sequences that finished or were aborted while the step ran (a step launched ahead) are
        dropped. Returns each kept token with its finish, if it ended its sequence.
        """
        for chunk in batch.prefills:  # chunks that sampled nothing
            if chunk.seq.status is SequenceStatus.RUNNING and not chunk.samples:
                self.block_manager.register_computed(chunk.seq)
        kept: list[tuple[SampledToken, Finish | None]] = []
        for s in sampled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.grammar is not None and not seq.grammar.accept(s.token_id):
                # Only a token the mask allowed can be sampled, so this is the grammar engine giving up (a
                # limit hit, an empty mask): the request ends here, without the token.
                self.finish(seq)
                kept.append((s, Finish(FinishReason.GRAMMAR,
                                       error=seq.grammar.error or "no token can continue the grammar")))
                continue
            seq.token_ids.append(s.token_id)
            self.block_manager.register_computed(seq)
            finish = self._check_stop(seq, s.token_id)
            if finish is not None:
                self.finish(seq)
            kept.append((s, finish))
        return kept

    def finish_scored(self, batch: ScheduledBatch) -> list[Sequence]:
        """End the sequences whose prompt this step completed and that generate nothing (max_tokens 0: pure
        scoring), by length; run after `postprocess`, which published their blocks."""
        done = [c.seq for c in batch.prefills
                if c.completes_prompt and not c.samples and c.seq.status is SequenceStatus.RUNNING]
        for seq in done:
            self.finish(seq)
        return done

    def _check_stop(self, seq: Sequence, token: int) -> Finish | None:
        p = seq.params
        if token in p.stop_token_ids:
            return Finish(FinishReason.STOP, token)
        if not p.ignore_eos and token in self.eos_token_ids:
            return Finish(FinishReason.STOP)
        if seq.grammar is not None and seq.grammar.is_terminated:
            # Complete: the grammar allows nothing but EOS from here, so stop now rather than sample it.
            return Finish(FinishReason.STOP, token_is_text=True)
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return Finish(FinishReason.LENGTH)
        return None
