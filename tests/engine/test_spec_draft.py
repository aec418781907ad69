"""A draft model proposes (`--speculative draft:PATH`): the output is decoding's without speculation, token for
token (greedy and seeded, batched and alone), a draft equal to the target has every proposal accepted, the draft's
KV goes with its sequence (abort, preemption), the Gumbel-coupled verification of a sampled proposal follows the
target distribution while the proposals follow the draft's, and a draft of another tokenizer is refused."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from test_spec_decode import GREEDY, assert_clean, engine, prompts, run, same
from tiny_model import build_tiny_model
from trillm.engine.errors import ModelLoadError
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.sampler import SampleRow, Sampler
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.sequence import Sequence
from trillm.engine.spec_draft import DraftProposer
from trillm.engine.spec_verify import position_rows


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random llama of the tiny model's tokenizer: 1 layer, hidden 64 (another KV layout)."""
    return build_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-draft", seed=1, num_layers=1, hidden_size=64,
                            intermediate_size=128)


def draft_engine(model: LoadedModel, path: Path, **kw: object) -> LLMEngine:
    return engine(model, speculative=f"draft:{path}", speculative_max_batch=16, **kw)


def proposer(eng: LLMEngine) -> DraftProposer:
    assert eng.speculator is not None and isinstance(eng.speculator.proposer, DraftProposer)
    return eng.speculator.proposer


def test_draft_greedy_and_seeded_identical_single_and_batched(tiny_model: LoadedModel, draft_path: Path) -> None:
    ps = prompts(tiny_model)
    ref = [o.new_token_ids for o in run(engine(tiny_model), ps, GREEDY)]
    eng = draft_engine(tiny_model, draft_path)
    assert [o.new_token_ids for o in run(eng, ps, GREEDY)] == ref  # batched
    assert [run(eng, [p], GREEDY)[0].new_token_ids for p in ps] == ref  # alone
    stats = eng.statistics()
    assert stats.spec_verifies > 10 and stats.spec_draft_tokens > 0, stats
    assert_clean(eng)
    seeded = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True,
                             repetition_penalty=1.1 if i % 2 else 1.0, logprobs=True) for i in range(len(ps))]
    for a, b in zip(run(draft_engine(tiny_model, draft_path), ps, seeded), run(engine(tiny_model), ps, seeded)):
        same(a, b)


def test_a_draft_equal_to_the_target_has_everything_accepted(tiny_model: LoadedModel, tiny_model_path: Path) -> None:
    ps = prompts(tiny_model)
    ref = [o.new_token_ids for o in run(engine(tiny_model), ps, GREEDY)]
    for batched in (True, False):
        eng = draft_engine(tiny_model, tiny_model_path, num_speculative_tokens=4)
        got = ([o.new_token_ids for o in run(eng, ps, GREEDY)] if batched
               else [run(eng, [p], GREEDY)[0].new_token_ids for p in ps])
        assert got == ref
        stats = eng.statistics()
        assert stats.spec_draft_tokens > 50 and stats.spec_accepted_tokens == stats.spec_draft_tokens, stats
        assert_clean(eng)
    # Sampled rows too: the draft samples with the target's noise, so an equal draft is always right.
    eng = draft_engine(tiny_model, tiny_model_path, num_speculative_tokens=4)
    run(eng, ps, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))  # unseeded: seeded at admission
    stats = eng.statistics()
    assert stats.spec_draft_tokens > 50 and stats.spec_accepted_tokens == stats.spec_draft_tokens, stats


def test_abort_and_preemption_free_the_drafts_kv(tiny_model: LoadedModel, tiny_model_path: Path,
                                                 draft_path: Path) -> None:
    ps = prompts(tiny_model)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ref = [o.new_token_ids for o in run(engine(tiny_model), ps, params)]
    # Preemption: the recomputed sequence's draft starts over; with an equal draft every proposal still holds,
    # which stale draft KV (another sequence's, in reused blocks) would break.
    eng = draft_engine(tiny_model, tiny_model_path, num_kv_blocks=32, block_size=4, num_speculative_tokens=4)
    got = [o.new_token_ids for o in run(eng, ps, params)]
    stats = eng.statistics()
    assert stats.num_preemptions > 0 and got == ref, stats
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0, stats
    assert_clean(eng)
    # Abort mid-speculation: every block (the target's and the draft's share ids) is free again.
    eng = draft_engine(tiny_model, draft_path)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, GREEDY)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    for step in range(60):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        if step == 5:
            assert eng.statistics().spec_verifies > 0
            eng.abort("r0")
            eng.abort("r2")
        eng.block_manager.check_invariants(eng.scheduler.running)
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    greedy_ref = run(engine(tiny_model), [ps[i] for i in (1, 3, 4)], GREEDY)
    assert [tuple(out[f"r{i}"]) for i in (1, 3, 4)] == [o.new_token_ids for o in greedy_ref]
    assert_clean(eng)
    pool = proposer(eng).runner.pool
    assert pool.keys[0].shape[0] == len(eng.block_manager.blocks)  # the draft's pool follows the target's


def test_gumbel_coupled_verification_follows_p_and_proposals_follow_q() -> None:
    """The draft samples q with the noise the target's verification uses at that position; the proposal is
    kept when the target's sample from p equals it. Kept-or-not, the emitted token follows p, the proposal
    follows q, and the acceptance rate is sum_i 1 / sum_j max(p_j / p_i, q_j / q_i)."""
    V, N = 6, 3000
    p = np.array([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    q = np.array([0.3, 0.3, 0.05, 0.1, 0.05, 0.2])  # far from p: TV 0.4
    rows, seqs = [], []
    for i in range(N):
        seq = Sequence(f"r{i}", [0], SamplingParams(temperature=1.0, seed=i))
        seqs.append(seq)
        rows.append(position_rows(SampleRow(seq.params, 0, [0], []), [])[-1])  # what DraftProposer samples with
    def sample(probs: np.ndarray) -> list[int]:
        logits = mx.array(np.log(probs)[None].repeat(N, 0).astype(np.float32))
        return Sampler(0).read(Sampler(0).sample(logits, rows)).token_ids

    proposals, targets = sample(q), sample(p)

    def chi2(counts: Counter[int], probs: np.ndarray) -> float:
        n = sum(counts.values())
        return float(sum((counts.get(t, 0) - n * x) ** 2 / (n * x) for t, x in enumerate(probs) if x > 0))

    assert chi2(Counter(proposals), q) < 20.5  # df 5: p = 0.001
    assert chi2(Counter(targets), p) < 20.5
    accepted = np.mean([a == b for a, b in zip(proposals, targets)])
    exact = sum(1 / max(1e-30, sum(max(p[j] / p[i], q[j] / q[i]) for j in range(V))) for i in range(V))
    tv = 0.5 * np.abs(p - q).sum()
    assert (1 - tv) / (1 + tv) <= exact <= 1 - tv
    assert abs(accepted - exact) < 4 * np.sqrt(exact * (1 - exact) / N), (accepted, exact)
    # Accepted proposals are distributed as P(X = Y = i) / P(accept), not as q: the coupling, checked per token.
    joint = np.array([1 / sum(max(p[j] / p[i], q[j] / q[i]) for j in range(V)) for i in range(V)])
    kept = Counter(a for a, b in zip(proposals, targets) if a == b)
    assert chi2(kept, joint / joint.sum()) < 20.5


def test_a_draft_of_another_tokenizer_is_refused(tiny_model: LoadedModel, draft_path: Path,
                                                 tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(draft_path, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.__getitem__)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="not the tokenizer of"):
        draft_engine(tiny_model, other)


def test_the_drafts_pool_comes_out_of_the_kv_memory_budget(tiny_model: LoadedModel, tiny_model_path: Path) -> None:
    """--kv-cache-memory-gb bounds both pools: a block id holds the target's KV and the draft's, so an equal draft
    halves the blocks the same budget buys."""
    budget = dict(num_kv_blocks=None, kv_cache_memory_gb=0.002, max_model_len=2048)
    plain = engine(tiny_model, **budget)
    with_draft = draft_engine(tiny_model, tiny_model_path, **budget)
    per_block = plain.kv_layout.bytes_per_block(8, tiny_model.dtype) if plain.kv_layout else 0
    assert plain.block_manager.num_blocks == 2_000_000 // per_block
    assert with_draft.block_manager.num_blocks == 2_000_000 // (2 * per_block)
    ps = prompts(tiny_model)
    assert [o.new_token_ids for o in run(with_draft, ps, GREEDY)] == [o.new_token_ids for o in run(plain, ps, GREEDY)]
