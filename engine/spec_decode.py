"""Speculative decoding inside the continuous batch: which decode rows speculate, and what is kept after.

A speculating decode row is a short chunk: its pending token and k proposed tokens go through the model in the
step's one decode forward (rows that do not speculate are padded, as prefill chunks are), and the sampler
samples every position as if the proposals had been accepted (engine/spec_verify.py). The proposal for
position j is kept while it equals the token sampled at position j - 1; the first token that differs is kept
too (it is the target's own sample there), and everything after is dropped. Since the sampler draws a seeded
row's noise from (seed, output index), the kept tokens are exactly those decoding without speculation draws:
greedy and seeded output is identical token for token, and any row's output follows the target distribution
(for a deterministic proposal, "sample from p, keep the proposal if equal" is standard rejection sampling:
accept with probability p(proposal), else a sample of the residual p without the proposal).

KV and the prefix cache: `plan` reserves slots for the k positions (blocks taken only from the free list:
speculation never preempts anyone), and `commit` advances the row's computed tokens by the accepted count only
and frees the blocks past them, before the scheduler publishes full blocks, so the prefix cache only ever sees
committed tokens. Rejected positions' K/V stay behind in the row's last block, past its computed tokens, and
are overwritten by the next step.

Adaptive k: a row drafts at most `k` tokens: after a partial acceptance its accepted count + 1 (but at least half
the bound), after a full one the bound; three verifications in a row with nothing accepted pause it for a number of decode steps that doubles
up to 64 (while paused, decode steps pipeline as without speculation). A row whose lookup finds nothing looks
up again at its next token: the step after is launched ahead only when no proposal can follow whatever it
samples (`Proposer.may_propose_next`). Nothing speculates when more than
`max_batch` rows decode: the batch then already fills the compute that speculation would use.
Not speculated: rows with a grammar (a proposal would need the grammar's mask at each position), and hybrid
models (a recurrent state cannot be rolled back; the engine does not build a speculator for them).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.ngram import FIRST_PAUSE, MAX_PAUSE, MISSES_BEFORE_PAUSE, SpecState
from trillm.engine.outputs import RequestOutput
from trillm.engine.runner import RowsFn
from trillm.engine.scheduler import SampledToken, ScheduledBatch
from trillm.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger("trillm.engine")


class Proposer(Protocol):
    """Proposes up to ks[i] next tokens of each running sequence seqs[i] (its prompt and output are
    `seq.token_ids`); rows(seq) is the sequence's sampling row for its next token. The slots of those k tokens
    are already reserved (a draft model writes its own KV there)."""

    def propose(self, seqs: list[Sequence], ks: list[int], rows: RowsFn) -> list[list[int]]: ...

    def may_propose_next(self, seq: Sequence) -> bool:
        """Whether seq could get a proposal at its next token, whatever token it samples now (False lets the
        step after this one be launched ahead)."""
        ...


class NgramProposer:
    """Prompt lookup over the sequence's own tokens (engine/ngram.py)."""

    def propose(self, seqs: list[Sequence], ks: list[int], rows: RowsFn) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks):
            assert seq.spec is not None
            seq.spec.index.update(seq.token_ids)
            out.append(seq.spec.index.propose(seq.token_ids, k))
        return out

    def may_propose_next(self, seq: Sequence) -> bool:
        assert seq.spec is not None
        seq.spec.index.update(seq.token_ids)
        return seq.spec.index.may_propose_after(seq.token_ids)


@dataclass(slots=True)
class SpecCounters:
    num_draft_tokens: int = 0  # proposed tokens verified
    num_accepted_tokens: int = 0  # of those, kept
    num_verifies: int = 0  # row-steps that verified a proposal


class StepRates:
    """Tokens per second of decode-only steps that verified proposals and of those that did not (moving
    averages of tokens and of seconds, each kind's rate their ratio): where a verify forward costs more than its
    accepted tokens bring (a multi-position forward that costs nearly L one-position ones, as with some
    quantized kernels), speculation holds off for `hold` steps, doubling up to MAX_HOLD while it keeps losing,
    then measures again.

    Tokens and seconds are averaged apart, not their quotient: pipelined steps read back in uneven pairs (one
    waits for two forwards, the next for almost nothing), and a mean of per-step rates would count the quick one
    as a burst of speed."""

    ALPHA = 0.2
    MIN_SAMPLES = 8
    MARGIN = 0.75  # held only when clearly losing: step times are noisy, and a hold costs the gains it skips
    FIRST_HOLD = 64
    MAX_HOLD = 2048

    def __init__(self) -> None:
        self.tokens = {True: 0.0, False: 0.0}
        self.seconds = {True: 0.0, False: 0.0}
        self.samples = {True: 0, False: 0}
        self.hold = 0  # steps left before speculation may resume
        self.next_hold = self.FIRST_HOLD
        self.num_holds = 0

    def rate(self, spec: bool) -> float:
        return self.tokens[spec] / self.seconds[spec] if self.seconds[spec] > 0 else 0.0

    def observe(self, spec: bool, num_tokens: int, seconds: float) -> None:
        n = self.samples[spec] = self.samples[spec] + 1
        a = 1.0 if n == 1 else self.ALPHA
        self.tokens[spec] += a * (num_tokens - self.tokens[spec])
        self.seconds[spec] += a * (seconds - self.seconds[spec])
        if self.hold:
            self.hold -= 1
            return
        if min(self.samples.values()) < self.MIN_SAMPLES or not spec:
            return
        if self.rate(True) < self.MARGIN * self.rate(False):
            self.hold, self.next_hold = self.next_hold, min(self.MAX_HOLD, 2 * self.next_hold)
            self.samples[True] = 0  # measured afresh after the hold
            self.num_holds += 1
        else:
            self.next_hold = self.FIRST_HOLD


class Speculator:
    def __init__(self, block_manager: BlockManager, max_model_len: int, num_tokens: int, *, max_batch: int = 4,
                 max_batched_tokens: int | None = None, proposer: Proposer | None = None,
                 seed: int = 0) -> None:
        assert num_tokens >= 1
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.max_batched_tokens = max_batched_tokens
        self.proposer: Proposer = proposer or NgramProposer()
        # Seeds for unseeded sampled requests, when the proposer samples with the target's noise (a draft model).
        self.seeds = np.random.default_rng(seed) if getattr(self.proposer, "shares_noise", False) else None
        self.counters = SpecCounters()
        self.rates = StepRates()

    def track(self, seq: Sequence) -> None:
        """Let seq speculate, unless its request opted out or it is constrained by a grammar."""
        if seq.params.speculative and seq.grammar is None:
            seq.spec = SpecState(self.num_tokens)
            if self.seeds is not None and not seq.params.greedy and seq.params.seed is None:
                # A draft samples its proposal with the noise the target's sampler will use at that position
                # (engine/spec_draft.py), which a seed fixes: an unseeded request gets one from the engine's stream.
                seq.params = dataclasses.replace(seq.params, seed=int(self.seeds.integers(0, 2**62)))

    def _may_speculate(self, batch: ScheduledBatch) -> bool:
        return 0 < len(batch.decodes) <= self.max_batch and self.rates.hold == 0

    def observe(self, batch: ScheduledBatch, seconds: float, num_tokens: int) -> None:
        """A decode-only step's duration and tokens: speculation stops while it pays less than plain decoding."""
        if not batch.prefills and batch.decodes and seconds > 0:
            self.rates.observe(bool(batch.drafts), num_tokens, seconds)

    def holds_pipeline(self, batch: ScheduledBatch) -> bool:
        """Whether the step after `batch` may speculate: then it is not launched ahead (its proposal needs the
        token this step samples). Not when no row could get a proposal whatever it samples (prompt lookup in a
        stretch of new text: its last token never began a bigram before)."""
        return self._may_speculate(batch) and any(
            s.spec is not None and s.spec.pause == 0 and self.proposer.may_propose_next(s)
            for s in batch.decodes)

    def plan(self, batch: ScheduledBatch, rows: RowsFn) -> None:
        """Propose for the step's decode rows and reserve slots for the proposals (after `Scheduler.schedule`)."""
        if not self._may_speculate(batch):
            return
        bm = self.block_manager
        budget = (self.max_batched_tokens - batch.num_tokens) if self.max_batched_tokens is not None else 1 << 30
        seqs: list[Sequence] = []
        ks: list[int] = []
        for seq in batch.decodes:
            st = seq.spec
            if st is None or st.pause or seq.grammar is not None:
                continue
            # At most k + 1 tokens come out of the step: within max_tokens and the context.
            k = min(st.k, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1, budget)
            if k <= 0 or not bm.can_append(seq, k):
                continue
            bm.may_append(seq, k)  # before proposing: a draft model writes its KV in these slots
            seqs.append(seq)
            ks.append(k)
            budget -= k
        if not seqs:
            return
        for seq, k, draft in zip(seqs, ks, self.proposer.propose(seqs, ks, rows)):
            draft = draft[:k]
            if len(draft) < k:  # give back the slots of what was not proposed
                bm.trim(seq, seq.num_computed_tokens + len(draft))
            if draft:  # else it looks up again at its next token (see holds_pipeline)
                batch.drafts[seq.request_id] = draft

    def commit(self, batch: ScheduledBatch, sampled: list[SampledToken]) -> None:
        """After the runner's collect, before `Scheduler.postprocess`: advance each speculating row by what it
        accepted, give back the slots of what it did not, and adapt its k."""
        emitted: dict[int, int] = {}
        for s in sampled:
            emitted[id(s.seq)] = emitted.get(id(s.seq), 0) + 1
        c = self.counters
        for seq in batch.decodes:
            st = seq.spec
            if st is None:
                continue
            draft = batch.drafts.get(seq.request_id)
            if draft is None:
                st.pause = max(0, st.pause - 1)
                continue
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted meanwhile: its blocks are already free
            accepted = max(0, emitted.get(id(seq), 1) - 1)
            seq.num_computed_tokens += accepted
            if st.draft_written:  # a draft model's KV holds the accepted proposals (the rejected ones are stale)
                st.draft_computed, st.draft_written = min(st.draft_written, seq.num_computed_tokens), 0
            # Keep the slot of the token it samples next (the step's last kept token, still pending).
            self.block_manager.trim(seq, seq.num_computed_tokens + 1)
            c.num_draft_tokens += len(draft)
            c.num_accepted_tokens += accepted
            c.num_verifies += 1
            self._adapt(st, len(draft), accepted)

    def _adapt(self, st: SpecState, proposed: int, accepted: int) -> None:
        # A forward of a few positions costs about as much as one of many (the weights are read once either way;
        # measured on CPU: 2 positions 1.5x one, 9 positions 1.9x), so k never drops below half its bound.
        if accepted == proposed:
            st.k = self.num_tokens
        else:
            st.k = max(accepted + 1, -(-self.num_tokens // 2))
        if accepted:
            st.misses = 0
            st.next_pause = FIRST_PAUSE
            return
        st.misses += 1
        if st.misses >= MISSES_BEFORE_PAUSE:
            st.pause, st.next_pause, st.misses = st.next_pause, min(MAX_PAUSE, 2 * st.next_pause), 0


def make_speculator(config: EngineConfig, block_manager: BlockManager, max_model_len: int, runner: object,
                    hybrid: bool, proposer: Proposer | None = None) -> Speculator | None:
    """The engine's speculator for `config.speculative`, or None: off, a runner that cannot verify proposals (the
    mock's, a tensor-parallel group's), or a hybrid model (its recurrent state cannot be rolled back).
    proposer: a draft model's (engine/spec_draft.py) for --speculative draft:PATH; else prompt lookup."""
    if config.speculative == "off":
        return None
    if not getattr(runner, "supports_speculation", False) or hybrid:
        why = "its recurrent state cannot be rolled back" if hybrid else "its runner cannot verify proposals"
        log.info("--speculative %s is off: %s", config.speculative, why)
        return None
    return Speculator(block_manager, max_model_len, config.num_speculative_tokens,
                      max_batch=config.speculative_max_batch, max_batched_tokens=config.max_num_batched_tokens,
                      proposer=proposer, seed=config.seed)


def token_rounds(sampled: list[SampledToken]) -> list[list[SampledToken]]:
    """A step's tokens in rounds: each sequence's first token, then the second of those that kept several
    (speculation), and so on; always at least one round, so the step's postprocessing runs."""
    rounds: list[list[SampledToken]] = [[]]
    seen: dict[int, int] = {}
    for s in sampled:
        r = seen.get(id(s.seq), 0)
        seen[id(s.seq)] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(s)
    return rounds


def merge_deltas(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One delta per request (its rounds' deltas joined, in order), in order of first appearance."""
    by_id: dict[str, list[RequestOutput]] = {}
    for o in outputs:
        by_id.setdefault(o.request_id, []).append(o)
    if len(by_id) == len(outputs):
        return outputs
    return [parts[0] if len(parts) == 1 else RequestOutput.concat(parts) for parts in by_id.values()]
