"""Speculative decoding inside the continuous batch: the output is what decoding without it gives, token for
token (greedy, seeded, with logprobs, stops, min/max tokens), the proposal index agrees with a brute-force scan,
the verification samples the target distribution, and rejected tokens leave no trace in the KV pool or the
prefix cache (also under abort and preemption)."""

from __future__ import annotations

import argparse
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trillm.engine.block_manager import block_hashes
from trillm.engine.config import EngineConfig, add_engine_arguments, engine_config_from_args
from trillm.engine.errors import InvalidRequest
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.ngram import NgramIndex
from trillm.engine.outputs import RequestOutput
from trillm.engine.sampler import SampleRow, Sampler
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduler import SampledToken
from trillm.engine.sequence import Sequence
from trillm.engine.spec_decode import StepRates
from trillm.engine.spec_verify import accepted_tokens, position_rows

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def engine(model: LoadedModel, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(block_size=8, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=model)  # type: ignore[arg-type]


def spec_engine(model: LoadedModel, **kw: object) -> LLMEngine:
    return engine(model, speculative="ngram", speculative_max_batch=16, **kw)


def prompts(model: LoadedModel) -> list[list[int]]:
    # Repetitive prompts, so prompt lookup finds proposals and the tiny model's greedy loops accept them.
    texts = ["the quick brown fox jumps over the lazy dog " * 3, "0123456789 " * 5, "a b c a b c a b c",
             "def add(a, b):\n    return a + b\n" * 2, "hello"]
    return [model.tokenizer.encode(t) for t in texts]


def run(eng: LLMEngine, ps: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    """generate(), checking the pool's invariants after every step."""
    plist = params if isinstance(params, list) else [params] * len(ps)
    ids = [f"r{i}" for i in range(len(ps))]
    for rid, p, sp in zip(ids, ps, plist):
        eng.add_request(rid, p, sp)
    merged: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    while eng.has_unfinished_requests():
        outs = eng.step()
        assert len({o.request_id for o in outs}) == len(outs), "one delta per request per step"
        for o in outs:
            merged[o.request_id].append(o)
        eng.block_manager.check_invariants(eng.scheduler.running)
    return [RequestOutput.concat(merged[rid]) for rid in ids]


def assert_clean(eng: LLMEngine) -> None:
    st_ = eng.statistics()
    assert st_.num_running == st_.num_waiting == st_.num_blocks_used == 0, st_
    eng.block_manager.check_invariants([])


def same(a: RequestOutput, b: RequestOutput) -> None:
    assert a.new_token_ids == b.new_token_ids
    assert (a.new_text, a.finish_reason, a.stop_reason, a.usage) == (b.new_text, b.finish_reason, b.stop_reason,
                                                                     b.usage)
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None and b.logprobs is not None:
        assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
        np.testing.assert_allclose([lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs], atol=1e-4)
        assert [[t for t, _ in lp.top] for lp in a.logprobs] == [[t for t, _ in lp.top] for lp in b.logprobs]


def mlx_lm_greedy(model: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own generate loop with its own dense KV cache: the independent reference."""
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model.model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]


# ---- the proposal index -------------------------------------------------------------------------------------
def brute_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix, by scanning; its continuation, periodic past the end."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                ext = list(tokens)
                c = start + n
                while len(ext) < L + k:
                    ext.append(ext[c + len(ext) - L])
                return ext[L:]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6), st.integers(0, 8))
def test_ngram_index_matches_a_brute_force_scan(tokens: list[int], k: int, grow: int) -> None:
    index = NgramIndex(min_n=2, max_n=4)
    cut = max(1, len(tokens) - grow)
    index.update(tokens[:cut])  # incremental: part now, the rest later
    index.update(tokens)
    assert index.propose(tokens, k) == brute_propose(tokens, k, 2, 4)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=30), st.integers(2, 3), st.integers(0, 8))
def test_ngram_index_says_no_proposal_can_follow_only_when_none_can(tokens: list[int], min_n: int, grow: int) -> None:
    """may_propose_after(t) is False only if no next token x gives t + [x] a proposal (so the step after may be
    launched ahead without losing one)."""
    index = NgramIndex(min_n=min_n, max_n=4)
    index.update(tokens[: max(0, len(tokens) - grow)])
    index.update(tokens)
    if not index.may_propose_after(tokens):
        for x in range(6):
            after = NgramIndex(min_n=min_n, max_n=4)
            after.update(tokens + [x])
            assert after.propose(tokens + [x], 2) == [], x


def test_ngram_index_knows_when_no_proposal_can_follow() -> None:
    index = NgramIndex(min_n=2, max_n=3)
    t = [1, 2, 3, 4]
    index.update(t)
    assert not index.may_propose_after(t)  # 4 never began a bigram: nothing can match "4 x"
    t2 = t + [2]
    index.update(t2)
    assert index.may_propose_after(t2) and index.propose(t2 + [3], 2) == [4, 2]  # "2 3" was seen: "2 x" may match
    loop = [7, 7]
    index3 = NgramIndex(2, 3)
    index3.update(loop)
    assert index3.may_propose_after(loop)  # nothing indexed, but "7 7" is, once the next token is known
    index3.update(loop + [7])
    assert index3.propose(loop + [7], 1) == [7]


def test_ngram_index_examples() -> None:
    index = NgramIndex(min_n=2, max_n=3)
    t = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    index.update(t)
    assert index.propose(t, 3) == [4, 9, 2]  # the longest suffix wins: "1 2 3" went on with 4 ("2 3" last with 5)
    t2 = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    index2 = NgramIndex(min_n=2, max_n=3)
    index2.update(t2)
    assert index2.propose(t2, 2) == [4, 9]
    loop = [7, 8, 7, 8]
    index3 = NgramIndex(2, 3)
    index3.update(loop)
    assert index3.propose(loop, 5) == [7, 8, 7, 8, 7]  # the period continues past the end
    assert NgramIndex(2, 3).propose([5, 6], 3) == []


# ---- the verification's sampling ------------------------------------------------------------------------------
def test_verification_samples_the_target_distribution() -> None:
    """A proposal d is kept with probability p(d); the token emitted first follows p (the residual p without d
    when d is rejected); after an acceptance the next token follows the next position's distribution. Fixed
    seeds: the counts are deterministic, the bounds generous."""
    V, N = 6, 2000
    p0 = np.array([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    p1 = np.array([0.3, 0.1, 0.2, 0.1, 0.1, 0.2])
    d = [1, 4]  # the proposal: position 0 should give 1, position 1 should give 4
    logits = mx.array(np.log(np.stack([p0, p1, p1]))[None].repeat(N, 0).reshape(3 * N, V).astype(np.float32))
    seqs, rows = [], []
    for i in range(N):
        seq = Sequence(f"r{i}", [0], SamplingParams(temperature=1.0, seed=i))
        seqs += [seq] * 3
        rows += position_rows(SampleRow(seq.params, 0, [0], []), d)
    lazy = Sampler(0).sample(logits, rows)
    result = Sampler(0).read(lazy)
    out = [SampledToken(s, t) for s, t in zip(seqs, result.token_ids)]
    kept = accepted_tokens(out, {f"r{i}": d for i in range(N)})
    by_seq: dict[str, list[int]] = {}
    for s in kept:
        by_seq.setdefault(s.seq.request_id, []).append(s.token_id)
    first = Counter(v[0] for v in by_seq.values())
    accepted = [v for v in by_seq.values() if v[0] == d[0]]
    rejected = [v[0] for v in by_seq.values() if v[0] != d[0]]
    assert all(len(v) == 1 for v in by_seq.values() if v[0] != d[0])  # nothing after a rejection

    def chi2(counts: Counter[int], probs: np.ndarray) -> float:
        n = sum(counts.values())
        return float(sum((counts.get(t, 0) - n * q) ** 2 / (n * q) for t, q in enumerate(probs) if q > 0))

    assert chi2(first, p0) < 20.5  # df 5: p = 0.001
    residual = p0.copy()
    residual[d[0]] = 0
    assert chi2(Counter(rejected), residual / residual.sum()) < 18.5  # df 4
    assert abs(len(accepted) / N - p0[d[0]]) < 4 * np.sqrt(p0[d[0]] * (1 - p0[d[0]]) / N)
    second = Counter(v[1] for v in accepted)
    assert chi2(second, p1) < 20.5
    # Whatever was accepted at position 1 came with a third token; a rejection there ended the row.
    assert all(len(v) == (3 if v[1] == d[1] else 2) for v in accepted)


# ---- exactness through the engine ---------------------------------------------------------------------------
def test_greedy_identical_single_batched_and_mlx_lm(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    ref = [o.new_token_ids for o in run(engine(tiny_model), ps, GREEDY)]
    for pipeline in (True, False):
        eng = spec_engine(tiny_model, pipeline_decode=pipeline)
        assert [o.new_token_ids for o in run(eng, ps, GREEDY)] == ref  # batched, every row speculating
        singles = [run(eng, [p], GREEDY)[0].new_token_ids for p in ps]
        assert singles == ref
        stats = eng.statistics()
        assert stats.spec_verifies > 10 and stats.spec_accepted_tokens > 10, stats  # proposals were accepted
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens  # and some rejected
        assert_clean(eng)
    for p, got in zip(ps[:2], ref[:2]):
        assert list(got) == mlx_lm_greedy(tiny_model, p, GREEDY.max_tokens)


def test_seeded_penalized_logprobs_and_limits_identical(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    params = [
        SamplingParams(max_tokens=30, temperature=0.9, top_k=20, top_p=0.95, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2,
                       ignore_eos=True, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # max_tokens inside one verification
        SamplingParams(max_tokens=30, min_tokens=12, temperature=0.7, seed=5, logprobs=True),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, presence_penalty=0.5, seed=3),
    ]
    ref = run(engine(tiny_model), ps, params)
    eng = spec_engine(tiny_model)
    for a, b in zip(run(eng, ps, params), ref):
        same(a, b)
    assert eng.statistics().spec_accepted_tokens > 0
    assert_clean(eng)


def test_stops_inside_an_accepted_run_end_the_request_there(tiny_model: LoadedModel) -> None:
    p = prompts(tiny_model)[3]  # an output of short loops: partial acceptances
    full = run(engine(tiny_model), [p], GREEDY)[0]
    ids = list(full.new_token_ids)
    late = next(t for i, t in enumerate(ids) if i >= 20 and t not in ids[:20])  # first seen after 20 tokens
    text = full.new_text
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop_str,)),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop_str,), include_stop_str_in_output=True),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(late,)),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(late,), min_tokens=30),
    ]
    for params in cases:
        ref = run(engine(tiny_model), [p], params)[0]
        eng = spec_engine(tiny_model)
        got = run(eng, [p], params)[0]
        same(got, ref)
        assert eng.statistics().spec_accepted_tokens > 0, params
        assert_clean(eng)


def test_grammar_rows_and_opted_out_requests_do_not_speculate(tiny_model: LoadedModel) -> None:
    from trillm.engine.grammar import GrammarSpec

    ps = prompts(tiny_model)[:2]
    regex = SamplingParams(max_tokens=20, temperature=0.0, grammar=GrammarSpec("regex", "(ab )+"))
    out_ref = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative=False)
    ref = run(engine(tiny_model), ps, [regex, out_ref])
    eng = spec_engine(tiny_model)
    eng.add_request("probe", ps[0], regex)
    eng.add_request("probe2", ps[1], out_ref)
    assert all(s.spec is None for s in eng.scheduler.waiting)
    eng.abort("probe"), eng.abort("probe2")
    got = run(eng, ps, [regex, out_ref])
    for a, b in zip(got, ref):
        same(a, b)
    assert eng.statistics().spec_verifies == 0
    with pytest.raises(InvalidRequest, match="speculative"):
        SamplingParams(speculative="yes")  # type: ignore[arg-type]


# ---- KV and prefix cache ------------------------------------------------------------------------------------
def test_prefix_cache_sees_only_committed_tokens(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    eng = spec_engine(tiny_model)
    bm = eng.block_manager
    probe = bm.cached_block_hashes  # the load-time probe's own prompts
    outs = run(eng, ps, GREEDY)
    committed = set()
    for p, o in zip(ps, outs):
        committed |= set(block_hashes(bm.hash_seed, p + list(o.new_token_ids), bm.block_size))
    assert eng.statistics().spec_draft_tokens > eng.statistics().spec_accepted_tokens  # there were rejections
    new = bm.cached_block_hashes - probe
    assert len(new) > 10 and new <= committed
    # A later request over a speculated prefix hits those blocks and continues exactly as a cold engine does.
    follow = ps[0] + list(outs[0].new_token_ids[:30])
    warm = run(eng, [follow], GREEDY)[0]
    assert warm.usage.cached_tokens >= 3 * bm.block_size
    cold = run(engine(tiny_model, enable_prefix_caching=False), [follow], GREEDY)[0]
    assert (warm.new_token_ids, warm.new_text) == (cold.new_token_ids, cold.new_text)
    assert_clean(eng)


def test_abort_mid_speculation_frees_everything(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    ref = run(engine(tiny_model), ps[1:], GREEDY)
    eng = spec_engine(tiny_model)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, GREEDY)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        steps += 1
        if steps == 6:
            assert eng.statistics().spec_verifies > 0
            eng.abort("r0")
        eng.block_manager.check_invariants(eng.scheduler.running)
    assert [tuple(got[f"r{i}"]) for i in range(1, len(ps))] == [o.new_token_ids for o in ref]
    assert_clean(eng)


def test_preemption_while_speculating_recomputes_identically(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ref = [o.new_token_ids for o in run(engine(tiny_model), ps, params)]
    eng = spec_engine(tiny_model, num_kv_blocks=32, block_size=4)
    got = [o.new_token_ids for o in run(eng, ps, params)]
    stats = eng.statistics()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0, stats
    assert got == ref
    assert_clean(eng)


# ---- control ------------------------------------------------------------------------------------------------
def test_rows_back_off_when_proposals_fail_and_large_batches_do_not_speculate(tiny_model: LoadedModel) -> None:
    class Wrong:
        def may_propose_next(self, seq: Sequence) -> bool:
            return True

        def propose(self, seqs: list[Sequence], ks: list[int], rows: object) -> list[list[int]]:
            # almost never the model's choice
            return [[(seq.token_ids[-1] + 1 + j) % 300 for j in range(k)] for seq, k in zip(seqs, ks)]

    eng = spec_engine(tiny_model)
    assert eng.speculator is not None
    eng.speculator.proposer = Wrong()
    out = run(eng, [prompts(tiny_model)[0]], GREEDY)[0]
    assert out.new_token_ids == run(engine(tiny_model), [prompts(tiny_model)[0]], GREEDY)[0].new_token_ids
    # paused after three misses: 4, then 8, then 16 steps (3 + 4 + 3 + 8 + 3 + 16 of the 39 decode steps)
    assert 3 <= eng.statistics().spec_verifies <= 12

    eng = engine(tiny_model, speculative="ngram", speculative_max_batch=2)
    run(eng, prompts(tiny_model), GREEDY)  # 5 rows decode together for most steps
    few = eng.statistics().spec_verifies
    eng2 = engine(tiny_model, speculative="ngram", speculative_max_batch=8)
    run(eng2, prompts(tiny_model), GREEDY)
    assert few < eng2.statistics().spec_verifies


def test_a_row_whose_lookup_finds_nothing_looks_up_again_at_its_next_token(tiny_model: LoadedModel) -> None:
    """No rest after an empty lookup: the next step asks again (launched ahead only when nothing can follow)."""
    asked: list[int] = []

    class Empty:
        def may_propose_next(self, seq: Sequence) -> bool:
            return True

        def propose(self, seqs: list[Sequence], ks: list[int], rows: object) -> list[list[int]]:
            asked.extend(s.num_output_tokens for s in seqs)
            return [[] for _ in seqs]

    eng = spec_engine(tiny_model)
    assert eng.speculator is not None
    eng.speculator.proposer = Empty()
    out = run(eng, [prompts(tiny_model)[0]], GREEDY)[0]
    assert out.new_token_ids == run(engine(tiny_model), [prompts(tiny_model)[0]], GREEDY)[0].new_token_ids
    # every decode step but the last (k would be 0 there) asked, each at the next output index
    assert asked == list(range(1, GREEDY.max_tokens - 1))
    assert eng.statistics().spec_verifies == 0


def test_config_and_flags() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    cfg = engine_config_from_args(ap.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "3",
                                                 "--speculative-max-batch", "2"]))
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.speculative_max_batch) == ("ngram", 3, 2)
    assert engine_config_from_args(ap.parse_args([])).speculative == "off"
    assert engine_config_from_args(ap.parse_args(["--speculative", "draft:/m/d"])).draft_model == "/m/d"
    for bad in (dict(speculative="eagle"), dict(speculative="draft:"), dict(speculative="ngram:x"),
                dict(num_speculative_tokens=0), dict(speculative_max_batch=0)):
        with pytest.raises(InvalidRequest):
            EngineConfig(**bad)  # type: ignore[arg-type]


def test_step_rates_average_time_not_per_step_rates() -> None:
    """Pipelined plain steps read back in uneven pairs (55 ms, then 4 ms for the next, already computed): their
    rate is 2 tokens per 59 ms, not the mean of 18 and 250 tok/s, which held off a speculation that paid 2x."""
    rates = StepRates()
    for _ in range(20):
        rates.observe(False, 1, 0.055)
        rates.observe(False, 1, 0.004)
        rates.observe(True, 4, 0.060)  # 67 tok/s against plain decoding's 34
    assert rates.rate(False) == pytest.approx(2 / 0.059, rel=0.15)
    assert rates.num_holds == 0
    losing = StepRates()
    for _ in range(20):
        losing.observe(False, 1, 0.030)
        losing.observe(True, 1, 0.060)
    assert losing.num_holds >= 1 and losing.hold > 0
