"""MockRunner: the engine's Runner with a timing model in place of a forward pass.

It plugs into LLMEngine(runner_factory=...), so the real Scheduler and BlockManager make every decision; only
the model is replaced. Each step's duration comes from a PerfModel (engine/mock/timing.py). Tokens come from a
seeded PRNG over the vocabulary's ordinary ids (never a special or EOS id, so a request produces exactly
max_tokens, like Dynamo's mocker), or are replayed from a Recording keyed by the prompt.

How the time passes is the caller's business: each Launch carries its predicted duration as
`virtual_seconds`, which an inline driver awaits (`trio.sleep`) on a virtual or real clock; or, given
`sleep=time.sleep`, `collect` blocks until the duration has passed (real time on an engine thread).
"""

from __future__ import annotations

import json
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trillm.engine.grammar import allowed_tokens
from trillm.engine.mock.timing import PerfModel, StepShape
from trillm.engine.mock.tokenizer import NUM_SPECIAL
from trillm.engine.outputs import TokenLogprob
from trillm.engine.prompt_logprobs import ScoredSpan, scored_span
from trillm.engine.runner import Launch, RowsFn
from trillm.engine.scheduler import SampledToken, ScheduledBatch
from trillm.engine.spec_verify import accepted_tokens

if TYPE_CHECKING:
    from trillm.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1
_MAX_STREAMS = 65536  # per-request PRNG keys kept; more live requests than this just recompute theirs


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prompt_key(prompt_token_ids: Iterable[int]) -> int:
    data = ",".join(map(str, prompt_token_ids)).encode()
    return zlib.crc32(data) | (zlib.adler32(data) << 32)


class Recording:
    """Recorded outputs to replay, keyed by prompt: JSONL of {"prompt_token_ids": [...], "output_token_ids": [...]}."""

    def __init__(self, pairs: Iterable[tuple[list[int], list[int]]] = ()) -> None:
        self._outputs: dict[int, list[int]] = {}
        for prompt, output in pairs:
            self.add(prompt, output)

    def add(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        self._outputs[prompt_key(prompt_token_ids)] = list(output_token_ids)

    def get(self, key: int) -> list[int] | None:
        return self._outputs.get(key)

    def __len__(self) -> int:
        return len(self._outputs)

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        pairs = []
        for line in Path(path).read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                pairs.append((d["prompt_token_ids"], d["output_token_ids"]))
        return cls(pairs)


class MockProposer:
    """Speculation's proposals in the mock (`--speculative` with the mock engine): each proposed token is the
    token the mock samples at that position with probability `acceptance` (drawn from the request's stream and the
    position, so a run is reproducible), else another; the verification keeps the run up to the first miss, so
    a row accepts a geometric number of tokens, as Dynamo's mocker models it."""

    def __init__(self, runner: MockRunner, acceptance: float) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"the speculative acceptance rate must be in [0, 1], got {acceptance}")
        self.runner = runner
        self.acceptance = acceptance

    def may_propose_next(self, seq: Sequence) -> bool:
        return True  # every row proposes

    def propose(self, seqs: list[Sequence], ks: list[int], rows: RowsFn) -> list[list[int]]:
        span = self.runner.vocab_size - NUM_SPECIAL
        out = []
        for seq, k in zip(seqs, ks):
            start = rows(seq).output_index
            key = self.runner._stream(seq)[0] ^ 0x5BD1E995  # the acceptance draws: their own stream
            draft = []
            for pos in range(start, start + k):
                token = self.runner._token(seq, pos)
                if splitmix64(key + pos) / 2.0**64 >= self.acceptance:
                    token = NUM_SPECIAL + (token - NUM_SPECIAL + 1) % span  # a miss
                draft.append(token)
            out.append(draft)
        return out


class MockRunner:
    supports_launch_ahead = False  # its steps take no time to launch: nothing to overlap
    supports_speculation = True  # the timing model prices verify steps; `proposer` stands in for any method

    def __init__(
        self,
        perf: PerfModel,
        *,
        vocab_size: int,
        num_blocks: int,
        seed: int = 0,
        speedup: float = 1.0,
        recording: Recording | None = None,
        sleep: Callable[[float], None] | None = None,
        spec_acceptance: float = 0.7,
        spec_draft_cost: float = 0.0,
    ) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        if spec_draft_cost < 0:
            raise ValueError(f"the draft's cost must be >= 0, got {spec_draft_cost}")
        self.perf = perf
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks
        self.seed = seed
        self.speedup = speedup
        self.recording = recording
        self.sleep = sleep
        self.total_step_s = 0.0
        self.num_steps = 0
        self._streams: OrderedDict[str, tuple[int, list[int] | None]] = OrderedDict()
        self.proposer = MockProposer(self, spec_acceptance)  # what the engine's speculator proposes with
        self.spec_draft_cost = spec_draft_cost  # a draft model's decode step, as a fraction of the target's

    def _stream(self, seq: Sequence) -> tuple[int, list[int] | None]:
        # Keyed by prompt (and seed), so a request's tokens do not depend on what it was batched with.
        hit = self._streams.get(seq.request_id)
        if hit is None:
            key = prompt_key(seq.token_ids[: seq.num_prompt_tokens])
            seed = seq.params.seed if seq.params.seed is not None else self.seed
            hit = (splitmix64(key ^ splitmix64(seed)), self.recording.get(key) if self.recording else None)
            self._streams[seq.request_id] = hit
            if len(self._streams) > _MAX_STREAMS:
                self._streams.popitem(last=False)
        return hit

    def _token(self, seq: Sequence, pos: int) -> int:
        key, recorded = self._stream(seq)
        if recorded is not None and pos < len(recorded):
            token = recorded[pos]
        else:
            token = NUM_SPECIAL + splitmix64(key + pos) % (self.vocab_size - NUM_SPECIAL)
        if pos + 1 >= seq.params.max_tokens:
            self._streams.pop(seq.request_id, None)  # its last token
        return token

    def _allowed_token(self, seq: Sequence, pos: int, token: int, bitmask: np.ndarray) -> int:
        """A grammar's row: the PRNG's (or the recording's) token if the mask allows it, else an allowed one
        picked by the same PRNG; with none allowed, the token stands and the grammar ends the request."""
        allowed = allowed_tokens(bitmask, self.vocab_size)
        if token < len(allowed) and allowed[token]:
            return token
        ids = np.flatnonzero(allowed)
        if not len(ids):
            return token
        return int(ids[splitmix64(self._stream(seq)[0] ^ (pos + 1)) % len(ids)])

    def launch(self, batch: ScheduledBatch, rows: RowsFn, check_abort: Callable[[], None] | None = None, *,
               after: Launch | None = None) -> Launch:
        """Price the step and pick its tokens now; `collect` hands them back (after sleeping, if asked to)."""
        assert after is None, "the mock runner does not launch ahead"
        t0 = time.perf_counter()
        for _ in batch.prefills:
            if check_abort is not None:
                check_abort()
        duration = (self.perf.step_seconds(StepShape.of(batch, self.num_blocks)) + self._draft_seconds(batch)) / self.speedup
        self.total_step_s += duration
        self.num_steps += 1
        sampled = []
        tokens = []
        for s in batch.sampled:
            row = rows(s)
            # A speculating row samples each of its 1 + k positions (engine/spec_verify.py); collect keeps the
            # accepted ones.
            for j in range(1 + len(batch.drafts.get(s.request_id, ()))):
                token = self._token(s, row.output_index + j)
                if row.token_bitmask is not None:
                    token = self._allowed_token(s, row.output_index, token, row.token_bitmask)
                tokens.append(token)
                sampled.append(s)
        scored = [self._scores(c.seq, *span) for c in batch.prefills if (span := scored_span(c)) is not None]
        return Launch(batch, sampled, _Pending(tokens, t0 + duration), duration, prompt_logprobs=scored or None)

    def _draft_seconds(self, batch: ScheduledBatch) -> float:
        """A draft model's proposals: its j-th forward decodes every row proposing more than j tokens, at
        `spec_draft_cost` of what the target's decode of those rows costs."""
        if not self.spec_draft_cost or not batch.drafts:
            return 0.0
        rows = [(len(d), s.num_computed_tokens) for s in batch.decodes if (d := batch.drafts.get(s.request_id))]
        steps = (StepShape(decode_contexts=tuple(ctx + j for k, ctx in rows if k > j)) for j in range(max(k for k, _ in rows)))
        return self.spec_draft_cost * sum(self.perf.step_seconds(shape) for shape in steps)

    def _scores(self, seq: Sequence, a: int, b: int) -> ScoredSpan:
        # Made-up but well-formed, like the sampled tokens' logprobs below.
        width = self.vocab_size - NUM_SPECIAL
        k = seq.params.prompt_logprobs or 0
        lps = []
        for t in seq.token_ids[a + 1 : b + 1]:
            top = tuple((NUM_SPECIAL + (t - NUM_SPECIAL + j) % width, -1.0 - j) for j in range(k))
            lps.append(TokenLogprob(t, -1.0, top, 1))
        return ScoredSpan(seq, a, tuple(lps))

    def collect_prompt_logprobs(self, launch: Launch) -> list[ScoredSpan]:
        return launch.prompt_logprobs if isinstance(launch.prompt_logprobs, list) else []

    def collect(self, launch: Launch) -> list[SampledToken]:
        pending = launch.pending
        if not isinstance(pending, _Pending):
            return []
        if self.sleep is not None and (left := pending.ready_at - time.perf_counter()) > 0:
            self.sleep(left)
        out = []
        span = self.vocab_size - NUM_SPECIAL
        for s, t in zip(launch.seqs, pending.tokens):
            lp = None
            if s.params.logprobs or s.params.top_logprobs:
                # Made-up but well-formed: the chosen token first, then its neighbours, each less likely.
                top = tuple((NUM_SPECIAL + (t - NUM_SPECIAL + j) % span, -1.0 - j) for j in range(s.params.top_logprobs))
                lp = TokenLogprob(t, -1.0, top)
            out.append(SampledToken(s, t, lp))
        return accepted_tokens(out, launch.batch.drafts) if launch.batch.drafts else out


@dataclass(frozen=True, slots=True)
class _Pending:
    tokens: list[int]
    ready_at: float  # perf_counter time the step's duration ends
