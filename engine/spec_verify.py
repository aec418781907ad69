"""The runner's side of speculative decoding: a speculating row's positions, their sampling rows, and which
sampled tokens are kept (the policy and the bookkeeping are in engine/spec_decode.py).

Position j of a row that proposed d_1..d_k holds d_j (position 0 the row's pending token); its logits give the
token after it, sampled with the row's parameters as if d_1..d_j had been generated: output index + j (a seeded
row's noise), the proposals counted by penalties, min_tokens' ban lifted where it would have been.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from trillm.engine.scheduler import SampledToken
from trillm.engine.sequence import Sequence

if TYPE_CHECKING:  # the mock runner keeps tokens with `accepted_tokens` without importing MLX
    from trillm.engine.sampler import SampleRow


def verify_tokens(seqs: list[Sequence], drafts: dict[str, list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each row's tokens (its pending token, then its proposal; right-padded with 0) and real length."""
    rows = [[s.token_ids[-1], *drafts.get(s.request_id, ())] for s in seqs]
    lengths = [len(r) for r in rows]
    L = max(lengths)
    return [r + [0] * (L - len(r)) for r in rows], lengths


def position_rows(row: SampleRow, draft: Seq[int]) -> list[SampleRow]:
    """The sampling rows of a speculating row's 1 + len(draft) positions (see the module docstring)."""
    assert row.token_bitmask is None, "grammar-constrained rows do not speculate"
    p = row.params
    out = [row]
    for j in range(1, len(draft) + 1):
        index = row.output_index + j
        out.append(dataclasses.replace(
            row, output_index=index,
            output_token_ids=row.output_token_ids + list(draft[:j]) if p.needs_penalties else row.output_token_ids,
            # The engine bans stop tokens only below min_tokens.
            banned_token_ids=row.banned_token_ids if index < p.min_tokens else ()))
    return out


def accepted_tokens(out: list[SampledToken], drafts: dict[str, list[int]]) -> list[SampledToken]:
    """The tokens a step keeps: for a speculating row (its 1 + k positions consecutive in `out`), the sampled
    tokens up to and including the first that differs from the proposal; every other row's one token."""
    kept: list[SampledToken] = []
    i = 0
    while i < len(out):
        draft = drafts.get(out[i].seq.request_id)
        if draft is None:
            kept.append(out[i])
            i += 1
            continue
        n = 0
        while n < len(draft) and out[i + n].token_id == draft[n]:
            n += 1
        kept += out[i : i + n + 1]
        i += len(draft) + 1
    return kept
