"""Vectorized sampling over a batch of rows, each with its own parameters.

Greedy rows take the argmax. Other rows use the Gumbel-max trick on filtered, temperature-scaled logits.
A seeded row draws its noise from a key derived from (seed, output index) only, so the same seed gives the
same text whatever else shares the batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import numpy as np

from trillm.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    output_index: int  # how many tokens this request has generated so far
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS before min_tokens
    token_bitmask: np.ndarray | None = None  # int32 [ceil(V/32)]: a grammar's allowed tokens (engine/grammar.py)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None] | None  # chosen tokens' logprobs (None for rows that did not ask)
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass(slots=True)
class LazySample:
    """A step's sampling results, not yet evaluated."""

    rows: list[SampleRow]
    tokens: mx.array  # int32 [N]
    chosen_logprobs: mx.array | None = None  # [N]
    top_ids: mx.array | None = None  # [N, k]
    top_logprobs: mx.array | None = None  # [N, k]
    logprob_rows: list[int] = field(default_factory=list)  # the rows the logprob arrays above cover, in order

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.chosen_logprobs, self.top_ids, self.top_logprobs) if a is not None]


def _row_key(seed: int, index: int) -> mx.array:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little") & ((1 << 63) - 1))


class Sampler:
    def __init__(self, seed: int = 0, vocab_size: int | None = None) -> None:
        self._seed = seed
        self._draws = 0  # unseeded rows still get a reproducible stream per engine
        # Models with a padded embedding (more logits than tokens) must never sample a padding id.
        self._vocab_size = vocab_size
        self._bit_cache: tuple[tuple[int, int], tuple[mx.array, mx.array, mx.array]] | None = None

    def sample(self, logits: mx.array, rows: list[SampleRow]) -> LazySample:
        """Build the sampling graph (nothing is evaluated): logits [N, V] -> tokens [N]."""
        logits = logits.astype(mx.float32)
        if self._vocab_size is not None and logits.shape[-1] > self._vocab_size:
            logits = logits[:, : self._vocab_size]
        N, V = logits.shape
        logits = self._apply_token_masks(logits, rows)  # first: no bias or filter can revive a masked token
        logits = self._apply_biases(logits, rows, V)

        greedy = mx.argmax(logits, axis=-1)
        sampled_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens = self._sample(logits, rows, sampled_rows, greedy) if sampled_rows else greedy
        out = LazySample(rows, tokens)
        # Only the rows that asked pay for logprobs, and top-k is a partition, not a full-vocabulary sort.
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs or r.params.top_logprobs]
        if lp_rows:
            out.logprob_rows = lp_rows
            sub = logits if len(lp_rows) == N else logits[mx.array(lp_rows)]
            chosen = tokens if len(lp_rows) == N else tokens[mx.array(lp_rows)]
            logp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
            out.chosen_logprobs = mx.take_along_axis(logp, chosen[:, None], axis=-1)[:, 0]
            k = max(rows[i].params.top_logprobs for i in lp_rows)
            if k:
                part = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
                vals = mx.take_along_axis(logp, part, axis=-1)
                order = mx.argsort(-vals, axis=-1)
                out.top_ids = mx.take_along_axis(part, order, axis=-1)
                out.top_logprobs = mx.take_along_axis(vals, order, axis=-1)
        return out

    def read(self, lazy: LazySample) -> SampleResult:
        """Evaluate (the step's one host sync) and bring the results to Python."""
        mx.eval(*lazy.arrays())
        token_list = cast("list[int]", lazy.tokens.tolist())
        if lazy.chosen_logprobs is None:
            return SampleResult(token_list, None, None)
        n = len(lazy.rows)
        chosen: list[float | None] = [None] * n
        top: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        values = cast("list[float]", lazy.chosen_logprobs.tolist())
        ids = cast("list[list[int]]", lazy.top_ids.tolist()) if lazy.top_ids is not None else None
        vals = cast("list[list[float]]", lazy.top_logprobs.tolist()) if lazy.top_logprobs is not None else None
        for j, i in enumerate(lazy.logprob_rows):
            chosen[i] = values[j]
            k = lazy.rows[i].params.top_logprobs
            if k and ids is not None and vals is not None:
                top[i] = list(zip(ids[j][:k], vals[j][:k]))
        return SampleResult(token_list, chosen, top)

    def _apply_token_masks(self, logits: mx.array, rows: list[SampleRow]) -> mx.array:
        """-inf for every token a row's grammar bitmask disallows; only the constrained rows are touched."""
        idx = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
        if not idx:
            return logits
        words = mx.array(np.stack([rows[i].token_bitmask for i in idx]).astype(np.int32, copy=False))  # type: ignore[misc]
        V = logits.shape[-1]
        word, bit, inside = self._bit_index(V, words.shape[1])
        allowed = ((mx.take(words, word, axis=1) >> bit) & 1).astype(mx.bool_) & inside
        if len(idx) == len(rows):
            return mx.where(allowed, logits, _NEG_INF)
        at = mx.array(idx)
        logits[at] = mx.where(allowed, logits[at], _NEG_INF)
        return logits

    def _bit_index(self, V: int, width: int) -> tuple[mx.array, mx.array, mx.array]:
        """Per vocabulary column: its bitmask word, its bit, and whether the mask covers it (padded vocab)."""
        key = (V, width)
        if self._bit_cache is None or self._bit_cache[0] != key:
            cols = np.arange(V)
            word = np.minimum(cols // 32, width - 1).astype(np.int32)
            self._bit_cache = (key, (mx.array(word), mx.array((cols % 32).astype(np.int32)), mx.array(cols < 32 * width)))
        return self._bit_cache[1]

    def _apply_biases(self, logits: mx.array, rows: list[SampleRow], V: int) -> mx.array:
        """Penalties, logit_bias and banned tokens; built only for rows that need them."""
        r_parts: list[np.ndarray] = []
        c_parts: list[np.ndarray] = []
        v_parts: list[np.ndarray] = []
        for i, r in enumerate(rows):
            ids, values = r.params.logit_bias_arrays
            if r.banned_token_ids:
                ids = np.concatenate([ids, np.asarray(r.banned_token_ids, np.int32)])
                values = np.concatenate([values, np.full(len(r.banned_token_ids), _NEG_INF, np.float32)])
            if len(ids):
                keep = ids < V
                r_parts.append(np.full(int(keep.sum()), i, np.int32))
                c_parts.append(ids[keep])
                v_parts.append(values[keep])
        if r_parts:
            add = mx.zeros(logits.shape, mx.float32)
            add = add.at[mx.array(np.concatenate(r_parts)), mx.array(np.concatenate(c_parts))].add(
                mx.array(np.concatenate(v_parts)))
            logits = logits + add

        pen_rows = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if pen_rows:
            counts = mx.zeros(logits.shape, mx.float32)  # generated-token counts
            seen = mx.zeros(logits.shape, mx.float32)  # prompt or generated
            cr: list[int] = []
            cc: list[int] = []
            sr: list[int] = []
            sc: list[int] = []
            rep = [1.0] * len(rows)
            pres = [0.0] * len(rows)
            freq = [0.0] * len(rows)
            for i in pen_rows:
                p = rows[i].params
                rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
                cr += [i] * len(rows[i].output_token_ids)
                cc += rows[i].output_token_ids
                if p.repetition_penalty != 1.0:
                    uniq = set(rows[i].prompt_token_ids) | set(rows[i].output_token_ids)
                    sr += [i] * len(uniq)
                    sc += list(uniq)
            if cr:
                counts = counts.at[mx.array(cr), mx.array(cc)].add(1.0)
            if sr:
                seen = seen.at[mx.array(sr), mx.array(sc)].add(1.0)
            rep_a = mx.array(rep)[:, None]
            penalized = mx.where(logits > 0, logits / rep_a, logits * rep_a)
            logits = mx.where(seen > 0, penalized, logits)
            logits = logits - mx.array(freq)[:, None] * counts - mx.array(pres)[:, None] * (counts > 0)
        return logits

    def _sample(self, logits: mx.array, rows: list[SampleRow], idx: list[int], greedy: mx.array) -> mx.array:
        sub = logits[mx.array(idx)]
        ps = [rows[i].params for i in idx]
        temp = mx.array([p.temperature for p in ps], mx.float32)[:, None]
        sub = sub / temp
        if any(p.top_k > 0 or p.top_p < 1.0 for p in ps):
            sorted_desc = -mx.sort(-sub, axis=-1)
            V = sub.shape[-1]
            if any(p.top_k > 0 for p in ps):
                kth = mx.array([min(p.top_k, V) - 1 if p.top_k > 0 else V - 1 for p in ps])
                thresh = mx.take_along_axis(sorted_desc, kth[:, None], axis=-1)
                sub = mx.where(sub < thresh, _NEG_INF, sub)
                sorted_desc = mx.where(mx.arange(V)[None] > kth[:, None], _NEG_INF, sorted_desc)
            if any(p.top_p < 1.0 for p in ps):
                top_p = mx.array([p.top_p for p in ps], mx.float32)[:, None]
                probs = mx.softmax(sorted_desc, axis=-1)
                before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
                keep = before < top_p
                thresh = mx.min(mx.where(keep, sorted_desc, float("inf")), axis=-1, keepdims=True)
                sub = mx.where(sub < thresh, _NEG_INF, sub)
        if any(p.min_p > 0.0 for p in ps):
            min_p = mx.array([p.min_p for p in ps], mx.float32)[:, None]
            logp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
            top = mx.max(logp, axis=-1, keepdims=True)
            sub = mx.where(logp < top + mx.log(mx.maximum(min_p, 1e-30)), _NEG_INF, sub)
        noise = mx.stack([self._noise(rows[i], sub.shape[-1]) for i in idx])
        picked = mx.argmax(sub + noise, axis=-1)
        return greedy.at[mx.array(idx)].add(picked - greedy[mx.array(idx)])

    def _noise(self, row: SampleRow, V: int) -> mx.array:
        if row.params.seed is not None:
            key = _row_key(row.params.seed, row.output_index)
        else:
            self._draws += 1
            key = _row_key(self._seed, -self._draws)
        return mx.random.gumbel(shape=(V,), key=key)
