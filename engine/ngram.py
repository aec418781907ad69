"""Prompt lookup: propose a request's next tokens by finding its latest tokens earlier in its own prompt + output.

Coding agents resend a file and edit it, so the output repeats stretches of the input; when the last n tokens
occurred before, the tokens that followed them then are a good guess of what follows now. No second model.
The index is incremental (each token is indexed once, when its continuation becomes known), so a proposal
costs a few dictionary lookups whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

# A row rests FIRST_PAUSE decode steps after MISSES_BEFORE_PAUSE fruitless verifications in a row; the rest
# doubles each time, up to MAX_PAUSE. Three, not two: in a code edit the output leaves the file for a renamed
# name or a rewritten line and comes back, and a rest of 4 after two misses there cost more decode steps than
# the misses (offline on the three served edits' greedy outputs, with the measured step costs).
MISSES_BEFORE_PAUSE = 3
FIRST_PAUSE = 4
MAX_PAUSE = 64


class NgramIndex:
    """Where each n-gram (min_n..max_n tokens) of one growing token list last occurred.

    `_next[gram]` is the index just after the gram's latest occurrence whose continuation is known: an
    n-gram ending at position e is indexed once position e + 1 exists, so the list's own suffix never
    matches itself.
    """

    __slots__ = ("min_n", "max_n", "_next", "_heads", "_indexed")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n
        self._next: dict[tuple[int, ...], int] = {}
        self._heads: set[tuple[int, ...]] = set()  # the first min_n - 1 tokens of every indexed min_n-gram
        self._indexed = 0  # continuations indexed so far: grams ending before position _indexed

    def update(self, tokens: Seq[int]) -> None:
        """Index every n-gram of `tokens` (the same list, grown) whose continuation is now known."""
        if len(tokens) < self._indexed:  # a shorter list is another list: start over
            self._next.clear()
            self._heads.clear()
            self._indexed = 0
        nxt, heads = self._next, self._heads
        for c in range(max(self._indexed, 1), len(tokens)):  # c: the continuation's index
            for n in range(self.min_n, min(self.max_n, c) + 1):
                nxt[tuple(tokens[c - n : c])] = c
            if c >= self.min_n:
                heads.add(tuple(tokens[c - self.min_n : c - 1]))
        self._indexed = max(self._indexed, len(tokens))

    def may_propose_after(self, tokens: Seq[int]) -> bool:
        """Whether `propose` could return anything once one more token is appended to `tokens` (indexed up to
        its end), whatever that token is: False only when no gram it could then end with was seen. Every indexed
        n-gram's last min_n tokens are an indexed min_n-gram too, so the last min_n - 1 tokens (which the unknown
        token will follow) must begin one: one indexed already, or the one that appending the token indexes
        (`tokens`' last min_n tokens, continued by it)."""
        h = self.min_n - 1
        if h == 0:
            return True
        if len(tokens) < h:
            return False
        head = tuple(tokens[len(tokens) - h :])
        return head in self._heads or (len(tokens) > h and tuple(tokens[len(tokens) - h - 1 : -1]) == head)

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `tokens` seen before (call `update` first).

        A continuation that runs into the suffix itself repeats it (a period of the list), so a loop of any
        length yields k tokens.
        """
        L = len(tokens)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            c = self._next.get(tuple(tokens[L - n :]))
            if c is None:
                continue
            draft: list[int] = []
            while len(draft) < k:
                i = c + len(draft)
                draft.append(tokens[i] if i < L else draft[i - L])
            return draft
        return []


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation state (`Sequence.spec`; engine/spec_decode.py drives it)."""

    k: int  # the most tokens its next proposal may have
    index: NgramIndex = field(default_factory=NgramIndex)
    pause: int = 0  # decode steps left before it proposes again
    next_pause: int = FIRST_PAUSE
    misses: int = 0  # consecutive verifications that accepted nothing
    # A draft model's KV of this sequence (engine/spec_draft.py), in the sequence's own blocks of the draft's pool:
    # valid for its first `draft_computed` tokens; `draft_written` (0: none) marks how far the step's proposal
    # wrote, until the verification says how much of it was accepted.
    draft_computed: int = 0
    draft_written: int = 0
    draft_preemptions: int = 0  # the sequence's preemptions when draft_computed was set (a preemption voids it)
