"""A draft model proposes (`--speculative draft:PATH`): a small model of the target's tokenizer, run on the engine
thread over its own paged KV pool, decodes k tokens for each speculating row before the step's verification.

KV: the draft's pool has the target's block count and ids (it grows and shrinks with it, engine/kv_slabs.py), so
a sequence's block table addresses both, and its draft KV is freed with it (finish, abort, preemption) at no
cost of its own. `SpecState.draft_computed` says how many of the sequence's tokens have draft KV; a proposal
first catches the draft up (the tokens decoded without speculation, or the whole prompt the first time: chunks
through the draft, like a prefill), then runs the pending token and k - 1 proposed tokens one forward each.
After the verification the draft's KV counts as valid up to the accepted tokens only (`Speculator.commit`): the
rejected positions' KV stays behind and is overwritten by the next proposal. A preemption voids it. The draft
KV of a block the prefix cache shares is rewritten with the same tokens by each sequence that catches up over
it: the draft's KV only ever steers proposals, never what the verification keeps.

Sampling: each proposed token is the draft's sample with the sampling row the target's verification uses at
that position (engine/spec_verify.py): the same temperature, filters, penalties (the proposal counted) and, for a
sampled row, the same Gumbel noise (drawn from the row's seed and output index; an unseeded request gets a seed
when it is admitted, `Speculator.track`). A greedy row's proposal is the draft's argmax. A sampled row's
proposal is a sample of the draft's distribution q, kept when it equals the target's sample from p under the
same noise: a Gumbel-coupled rejection sampler. The kept tokens are the target's own samples, so the output is
the one decoding without speculation gives, token for token, and follows p; a proposal is accepted with
probability sum_i 1 / sum_j max(p_j / p_i, q_j / q_i), which is 1 when q = p and at least (1 - TV) / (1 + TV)
(TV: the total variation distance of p and q); the standard rejection sampler (accept with min(1, p / q),
resample the residual) accepts 1 - TV but draws other tokens than decoding without speculation does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlx.core as mx

from trillm.engine.errors import ModelLoadError
from trillm.engine.model_runner import ModelRunner, group_chunks, prepare_inputs
from trillm.engine.runner import RowsFn
from trillm.engine.scheduler import PrefillChunk
from trillm.engine.sequence import Sequence
from trillm.engine.spec_verify import position_rows

if TYPE_CHECKING:
    from trillm.engine.loader import LoadedModel

_PROBE_TEXTS = ("Hello, world! def f(x):\n    return x * 2  # 3.14159", "Café naïve 東京 😀 → ∑", " \t\n  ")


def check_draft_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse, in one line, a draft whose token ids mean other text than the target's."""
    t, d = target.tokenizer, draft.tokenizer
    why = None
    if t.vocab_size != d.vocab_size:
        why = f"vocabularies of {t.vocab_size} and {d.vocab_size} tokens"
    elif (draft.vocab_size or d.vocab_size) < t.vocab_size:
        why = f"the draft's LM head has {draft.vocab_size} rows for {t.vocab_size} tokens"
    elif t.eos_token_ids != d.eos_token_ids:
        why = f"end-of-sequence tokens {sorted(t.eos_token_ids)} and {sorted(d.eos_token_ids)}"
    else:
        ids = range(0, t.vocab_size, max(1, t.vocab_size // 512))
        if any(t.encode(x) != d.encode(x) for x in _PROBE_TEXTS) or any(
                t.token_bytes(i) != d.token_bytes(i) for i in ids):
            why = "tokenizers that split text differently"
    if why is not None:
        raise ModelLoadError(f"--speculative draft:{draft.name}: not the tokenizer of {target.name} ({why})")


class DraftProposer:
    """Proposes with a draft model through its own `ModelRunner` (its pool, its kernels, its sampler)."""

    shares_noise = True  # sampled rows need seeds (Speculator.track): the proposal reuses the target's noise

    def __init__(self, runner: ModelRunner, max_chunk: int) -> None:
        self.runner = runner
        self.max_chunk = max_chunk  # the longest catch-up chunk, as a prefill chunk of the target
        self.num_forwards = 0

    def may_propose_next(self, seq: Sequence) -> bool:
        return True  # a draft model proposes whatever the context

    def propose(self, seqs: list[Sequence], ks: list[int], rows: RowsFn) -> list[list[int]]:
        bs = self.runner.pool.block_size
        for s in seqs:
            st = s.spec
            assert st is not None
            if st.draft_preemptions != s.num_preemptions:  # its blocks were freed and refilled: start over
                st.draft_computed, st.draft_preemptions = 0, s.num_preemptions
        self._catch_up(seqs)
        base = [rows(s) for s in seqs]
        # Without penalties a sampling row does not read the proposal so far, so each forward is fed the previous
        # one's samples unread and the proposals are read back once; with them, each step is read back.
        lazy = not any(r.params.needs_penalties for r in base)
        drafts: list[list[int]] = [[] for _ in seqs]
        steps: list[tuple[list[int], mx.array]] = []  # (rows, their samples) per forward, unread
        prev: tuple[list[int], mx.array] | None = None
        for j in range(max(ks)):
            live = [i for i, k in enumerate(ks) if k > j]
            live_seqs = [seqs[i] for i in live]
            # Position n - 1 + j: the pending token (j = 0), then the proposal so far.
            starts = [seqs[i].num_tokens - 1 + j for i in live]
            if j == 0:
                tokens = None
            elif prev is not None:  # lazy: the previous step's samples of the rows still proposing
                at = {i: n for n, i in enumerate(prev[0])}
                picked = [at[i] for i in live]
                samples = prev[1] if len(picked) == len(prev[0]) else prev[1][mx.array(picked)]
                tokens = samples.reshape(-1, 1).astype(mx.int32)
            else:
                tokens = mx.array([[drafts[i][-1]] for i in live], mx.int32)
            logits = self.runner.forward(prepare_inputs(live_seqs, starts, [1] * len(live), bs, tokens))
            self.num_forwards += 1
            sample_rows = [position_rows(base[i], drafts[i] if not lazy else [0] * j)[-1] for i in live]
            sampled = self.runner.sampler.sample(logits, sample_rows)
            if lazy:
                mx.async_eval(sampled.tokens, *self.runner.pool.arrays())
                prev = (live, sampled.tokens)
                steps.append(prev)
                continue
            for i, token in zip(live, self.runner.sampler.read(sampled).token_ids):
                drafts[i].append(token)
        if steps:
            mx.eval(*(a for _, a in steps))
            for live, a in steps:
                for i, token in zip(live, cast("list[int]", a.tolist())):
                    drafts[i].append(token)
        for s, k in zip(seqs, ks):
            assert s.spec is not None
            s.spec.draft_computed = s.num_tokens - 1  # every token before the pending one
            s.spec.draft_written = s.num_tokens - 1 + k  # and the pending one, then d_1 .. d_k-1
        return drafts

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Draft KV for every token before each row's pending one, in chunks (a row's chunks in order, one per
        forward: a chunk attends to its predecessor's KV)."""
        rounds: list[list[PrefillChunk]] = []
        for s in seqs:
            assert s.spec is not None
            start, end = s.spec.draft_computed, s.num_tokens - 1
            r = 0
            while start < end:
                n = min(self.max_chunk, end - start)
                if r == len(rounds):
                    rounds.append([])
                rounds[r].append(PrefillChunk(s, start, n))
                start, r = start + n, r + 1
        for chunks in rounds:
            for group in group_chunks(chunks):
                self.runner.forward(self.runner.prepare_prefill(group))
                self.num_forwards += 1
                mx.async_eval(*self.runner.pool.arrays())
