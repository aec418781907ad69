"""Prompt logprobs against an independent truth: a full forward of mlx-lm's own model on the same weights."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from trillm.engine.prompt_logprobs import score
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.sequence import Sequence

ATOL = 1e-4  # fp32: chunked paged attention vs one dense forward


def engine(model: LoadedModel, **kw: object) -> LLMEngine:
    cfg = dict(block_size=16, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=model)  # type: ignore[arg-type]


def truth(model: LoadedModel, ids: list[int]) -> np.ndarray:
    """log-softmax over mlx-lm's logits of the whole prompt in one forward (its own attention, no cache),
    taken in float64 (MLX's fp32 logsumexp over a 49k vocabulary is itself off by ~3e-4)."""
    logits = np.array(model.model(mx.array(ids)[None])[0].astype(mx.float32)).astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))


def assert_matches(model: LoadedModel, ids: list[int], got: tuple[TokenLogprob | None, ...] | None, k: int,
                   atol: float = ATOL) -> None:
    ATOL = atol  # noqa: N806
    assert got is not None and len(got) == len(ids) and got[0] is None
    ref = truth(model, ids)
    for pos in range(1, len(ids)):
        lp = got[pos]
        row = ref[pos - 1]
        assert lp is not None and lp.token_id == ids[pos]
        assert lp.logprob == pytest.approx(row[ids[pos]], abs=ATOL), pos
        # the rank, up to ties within the noise
        lo, hi = 1 + int((row > row[ids[pos]] + ATOL).sum()), 1 + int((row > row[ids[pos]] - ATOL).sum())
        assert lp.rank is not None and lo <= lp.rank <= hi, (pos, lp.rank, lo, hi)
        assert len(lp.top) == k
        ids_, values = [t for t, _ in lp.top], [v for _, v in lp.top]
        assert np.allclose(values, -np.sort(-row)[:k], atol=ATOL)  # the k best values, best first
        assert np.allclose(row[ids_], values, atol=ATOL)  # each the logprob of the token it names


def texts(model: LoadedModel) -> list[list[int]]:
    tok = model.tokenizer
    return [tok.encode(t) for t in ("hello", "The quick brown fox jumps over the lazy dog. " * 5,
                                    "def add(a, b):\n    return a + b\n" * 3, "Café, naïve, résumé, 東京は日本の首都です。")]


def test_prompt_logprobs_equal_a_full_mlx_lm_forward(tiny_model: LoadedModel) -> None:
    eng = engine(tiny_model)
    ps = texts(tiny_model)
    outs = eng.generate(ps, SamplingParams(max_tokens=0, prompt_logprobs=5))
    for ids, out in zip(ps, outs):
        assert out.new_token_ids == () and out.finish_reason is FinishReason.LENGTH
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
        assert_matches(tiny_model, ids, out.prompt_logprobs, 5)
    assert eng.statistics().num_blocks_used == 0


def test_across_chunk_boundaries_and_batched_with_generation(tiny_model: LoadedModel) -> None:
    ps = texts(tiny_model)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = [o.new_token_ids for o in engine(tiny_model).generate(ps, greedy)]
    # 24-token chunks: the long prompts span several steps, each chunk batched with other rows' chunks
    # and with decodes of the generating requests.
    eng = engine(tiny_model, max_num_batched_tokens=24, max_num_seqs=8)
    scoring = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=k) for k in (0, 1, 3, 20)]
    outs = eng.generate(ps + ps, scoring + [greedy] * len(ps))
    assert any(len(ids) > 3 * 24 for ids in ps)
    for ids, out, p in zip(ps, outs, scoring):
        assert_matches(tiny_model, ids, out.prompt_logprobs, p.prompt_logprobs or 0)
        assert len(out.new_token_ids) == 3
    assert [o.new_token_ids for o in outs[len(ps):]] == alone  # scoring rows do not disturb the others
    assert all(o.prompt_logprobs is None for o in outs[len(ps):])
    # The first generated token is the truth's argmax after the whole prompt.
    for ids, out in zip(ps, outs):
        assert out.new_token_ids[0] == int(np.argmax(np.array(tiny_model.model(mx.array(ids)[None])[0, -1])))


def test_prefix_cache_hit_is_bypassed_and_still_right(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    shared = tok.encode("system: you are a helpful assistant. " * 6)
    ids = shared + tok.encode("What is the capital of France?")
    eng = engine(tiny_model)
    gen = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    warm = eng.generate([shared + tok.encode("hi")], gen)[0]
    assert eng.generate([ids], gen)[0].usage.cached_tokens >= 32  # the cache holds this prompt's blocks
    out = eng.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.usage.cached_tokens == 0  # a scoring request computes every position
    assert_matches(tiny_model, ids, out.prompt_logprobs, 2)
    # and what a scoring request computed is published for later requests
    fresh = engine(tiny_model)
    fresh.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert fresh.generate([ids], gen)[0].usage.cached_tokens >= 32
    assert warm.usage.cached_tokens == 0


def test_preempted_scoring_requests_stay_right(tiny_model: LoadedModel) -> None:
    ps = texts(tiny_model)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=1)] * len(ps)
    ref = [o.new_token_ids for o in engine(tiny_model).generate(ps, params)]
    eng = engine(tiny_model, num_kv_blocks=24, block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    preempt = eng.scheduler._preempt
    outputs_at_preemption: list[int] = []

    def watched(seq: Sequence) -> None:  # observe which requests get preempted, and when
        outputs_at_preemption.append(seq.num_output_tokens)
        preempt(seq)

    eng.scheduler._preempt = watched  # type: ignore[method-assign]
    outs = eng.generate(ps, params)
    assert 0 in outputs_at_preemption  # one was preempted mid-prefill, before its prompt logprobs went out
    assert any(n > 0 for n in outputs_at_preemption)  # and one after
    assert [o.new_token_ids for o in outs] == ref
    for ids, out in zip(ps, outs):
        assert_matches(tiny_model, ids, out.prompt_logprobs, 1)
    eng.block_manager.check_invariants([])


def test_single_token_prompt_and_one_delta_only(tiny_model: LoadedModel) -> None:
    eng = engine(tiny_model)
    out = eng.generate([[7]], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == (None,) and out.new_token_ids == ()
    # prompt logprobs come once, with the first delta
    eng.add_request("r", texts(tiny_model)[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                            prompt_logprobs=0))
    deltas: list[RequestOutput] = []
    while eng.has_unfinished_requests():
        deltas += eng.step()
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    assert RequestOutput.concat(deltas).prompt_logprobs == deltas[0].prompt_logprobs


def test_scoring_in_pieces_equals_one_piece(tiny_model: LoadedModel) -> None:
    ids = texts(tiny_model)[1]
    seq = Sequence("s", ids, SamplingParams(max_tokens=0, prompt_logprobs=4))
    hidden = tiny_model.model.model(mx.array(ids)[None])[0, :-1]
    head = tiny_model.model.lm_head
    whole, pieces = score(seq, 0, hidden, head, piece=len(ids)).read(), score(seq, 0, hidden, head, piece=7).read()
    assert len(whole.logprobs) == len(pieces.logprobs) == len(ids) - 1
    for a, b in zip(whole.logprobs, pieces.logprobs):  # equal up to the matmul's blocking
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=ATOL)


@pytest.mark.slow
def test_default_model_prompt_logprobs_equal_mlx_lm(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 4}])
    eng = LLMEngine(EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32), loaded=default_model)
    out = eng.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert len(ids) > 32  # at least one chunk boundary
    # Its Q4_1 weights stay quantized on CPU, where quant_linear rounds x to int16 per block of 32 for rows of
    # up to 32 (a chunk here): up to ~3e-3 of logprob against mlx-lm's float quantized matmul (an off-by-one
    # position or a wrong top-k is off by whole units).
    assert_matches(default_model, ids, out.prompt_logprobs, 2, atol=1e-2)


@pytest.mark.parametrize("vocab", [512, 49152, 50001, 700])
@pytest.mark.parametrize("k", [2, 5, 20])
def test_blocked_top_k_equals_a_full_partition(vocab: int, k: int) -> None:
    from trillm.engine.prompt_logprobs import _top_k

    rng = np.random.default_rng(vocab + k)
    logits = rng.standard_normal((9, vocab)).astype(np.float32)
    logits[0, -3:] = [50.0, 51.0, 52.0]  # the best in the ragged tail
    logits[1, :k] = 40.0 + np.arange(k)  # all in one block
    want = np.argpartition(logits, -k, axis=1)[:, -k:]
    assert [set(r) for r in _top_k(logits, k).tolist()] == [set(r) for r in want.tolist()]
