"""LLMEngine end to end on a tiny random llama: paths that must agree do agree, and nothing leaks."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest

from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest, ModelNotFound, UnknownRequest
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.outputs import FinishReason
from trillm.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def engine(model: LoadedModel, **kw: object) -> LLMEngine:
    cfg = dict(block_size=16, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=model)  # type: ignore[arg-type]


def prompts(model: LoadedModel) -> list[list[int]]:
    texts = ["hello", "the quick brown fox jumps over the lazy dog " * 3, "a b c", "once upon a time there was",
             "0123456789 " * 6]
    return [model.tokenizer.encode(t) for t in texts]


def assert_no_leak(eng: LLMEngine) -> None:
    st = eng.statistics()
    assert st.num_running == st.num_waiting == 0 and st.num_blocks_used == 0, st
    eng.block_manager.check_invariants([])


def mlx_lm_greedy(model: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own generate loop with its own dense KV cache: the independent reference."""
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(prompt), model.model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
    return out


def test_batch_equals_single_and_mlx_lm(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    eng = engine(tiny_model)
    batched = [o.new_token_ids for o in eng.generate(ps, GREEDY)]
    singles = [engine(tiny_model).generate([p], GREEDY)[0].new_token_ids for p in ps]
    assert batched == singles
    for p, got in zip(ps, batched):
        assert list(got) == mlx_lm_greedy(tiny_model, p, GREEDY.max_tokens)
    assert_no_leak(eng)


def test_chunked_prefill_equals_unchunked(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    ref = [o.new_token_ids for o in engine(tiny_model, enable_chunked_prefill=False).generate(ps, GREEDY)]
    eng = engine(tiny_model, max_num_batched_tokens=16, block_size=16)  # chunks of at most 16 - decodes
    assert [o.new_token_ids for o in eng.generate(ps, GREEDY)] == ref
    assert_no_leak(eng)


def test_prefix_cache_hit_equals_cold_run(tiny_model: LoadedModel) -> None:
    shared = tiny_model.tokenizer.encode("system: you are a helpful assistant. " * 4)
    p1, p2 = shared + tiny_model.tokenizer.encode("hi"), shared + tiny_model.tokenizer.encode("bye now")
    cold = engine(tiny_model, enable_prefix_caching=False).generate([p2], GREEDY)[0]
    eng = engine(tiny_model)
    eng.generate([p1], GREEDY)
    warm = eng.generate([p2], GREEDY)[0]
    assert warm.usage.cached_tokens >= 16 and cold.usage.cached_tokens == 0
    assert warm.new_token_ids == cold.new_token_ids
    again = eng.generate([p2], GREEDY)[0]  # a full-prompt hit recomputes the last block
    assert again.new_token_ids == cold.new_token_ids and again.usage.cached_tokens > warm.usage.cached_tokens - 16
    assert eng.statistics().prefix_cache_hit_rate > 0
    assert_no_leak(eng)


def test_preemption_then_recompute_equals_uninterrupted(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = [o.new_token_ids for o in engine(tiny_model).generate(ps, params)]
    eng = engine(tiny_model, num_kv_blocks=20, block_size=8, enable_prefix_caching=False)
    got = [o.new_token_ids for o in eng.generate(ps, params)]
    assert eng.statistics().num_preemptions > 0
    assert got == ref
    assert_no_leak(eng)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine(tiny_model).generate([ps[0]], seeded)[0].new_token_ids
    assert engine(tiny_model).generate([ps[0]], seeded)[0].new_token_ids == alone
    others = [SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)] * (len(ps) - 1)
    mixed = engine(tiny_model).generate(ps, [seeded, *others])[0].new_token_ids
    assert mixed == alone
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert engine(tiny_model).generate([ps[0]], other_seed)[0].new_token_ids != alone


def test_stop_string_across_token_boundary_is_trimmed(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    eng = engine(tiny_model)
    p = prompts(tiny_model)[3]
    full = eng.generate([p], GREEDY)[0]
    ids = list(full.new_token_ids)
    # A stop string made of the end of token 4's text and the start of token 5's.
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    i = next(i for i in range(3, len(ids) - 1) if len(pieces[i + 1]) - len(pieces[i]) >= 1 and len(pieces[i]) - len(pieces[i - 1]) >= 1)
    stop = pieces[i][-1:] + pieces[i + 1][len(pieces[i]) : len(pieces[i]) + 1]
    assert stop in full.new_text
    out = eng.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert out.new_text == full.new_text[: full.new_text.index(stop)]
    assert_no_leak(eng)


def test_stop_token_min_tokens_and_logprobs(tiny_model: LoadedModel) -> None:
    eng = engine(tiny_model)
    p = prompts(tiny_model)[0]
    eos = min(tiny_model.eos_token_ids)
    forced = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((eos, 100.0),), min_tokens=3)
    out = eng.generate([p], forced)[0]
    assert len(out.new_token_ids) == 4 and out.new_token_ids[-1] == eos and out.finish_reason is FinishReason.STOP
    assert eos not in out.new_token_ids[:3]
    first = eng.generate([p], SamplingParams(max_tokens=1, temperature=0.0))[0].new_token_ids[0]
    o2 = eng.generate([p], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(first,)))[0]
    assert o2.new_token_ids == (first,) and o2.stop_reason == first and o2.finish_reason is FinishReason.STOP
    o3 = eng.generate([p], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3))[0]
    assert o3.logprobs is not None and len(o3.logprobs) == 5
    for lp in o3.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy = best
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert o3.finish_reason is FinishReason.LENGTH
    assert_no_leak(eng)


def test_multibyte_utf8_streams_intact(tiny_model: LoadedModel) -> None:
    from trillm.engine.detokenizer import IncrementalDetokenizer

    tok = tiny_model.tokenizer
    text = "héllo wörld 世界 🎉🎉 naïve café ✓"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    chunks = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)


def test_bad_input_clear_errors_and_no_leak(tiny_model: LoadedModel) -> None:
    eng = engine(tiny_model, max_model_len=64)
    with pytest.raises(InvalidRequest, match="context length"):
        eng.add_request("long", list(range(100)), GREEDY)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=-5)
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(UnknownRequest):
        eng.abort("nope")
    with pytest.raises(InvalidRequest, match="token ids"):
        eng.add_request("bad", [10**9], GREEDY)
    eng.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequest, match="already"):
        eng.add_request("dup", [1, 2, 3], GREEDY)
    eng.step()
    eng.abort("dup")  # abort between steps frees every block
    assert_no_leak(eng)
    with pytest.raises(ModelNotFound):
        LLMEngine(EngineConfig(model="/no/such/model"))


def test_abort_mid_prefill_and_mid_decode(tiny_model: LoadedModel) -> None:
    eng = engine(tiny_model, max_num_batched_tokens=16)
    long = tiny_model.tokenizer.encode("lorem ipsum dolor sit amet " * 10)
    eng.add_request("a", long, GREEDY)
    eng.add_request("b", [5, 6, 7], GREEDY)
    eng.step()
    assert eng.scheduler.running[0].num_pending_tokens > 1  # "a" is mid-prefill
    eng.abort("a")
    for _ in range(3):
        eng.step()
    eng.abort("b")
    assert_no_leak(eng)
    assert not eng.step()


def test_engine_never_imports_trio() -> None:
    code = ("import sys, trillm.engine.llm_engine, trillm.engine.loader;"
            "bad = [m for m in ('trio', 'quart', 'quart_trio', 'hypercorn', 'anyio') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_default_model_paris_and_matches_mlx_lm(default_model: LoadedModel) -> None:
    # The batch limits of the other default-model tests: one kernel self-check (~8 s) serves them all.
    eng = LLMEngine(EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256), loaded=default_model)
    p = default_model.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = eng.generate([p], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in out.new_text
    ref = mlx_lm_greedy(default_model, p, len(out.new_token_ids))
    assert list(out.new_token_ids) == ref


def test_requests_arriving_together_share_a_long_prefix_once(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    system = tok.encode("system: you are a careful assistant who answers briefly. " * 6)
    assert len(system) >= 80
    ps = [system + tok.encode(q) for q in ("what is red", "name a fish", "count to three")]
    cold = [engine(tiny_model, enable_prefix_caching=False).generate([p], GREEDY)[0].new_token_ids for p in ps]
    eng = engine(tiny_model)
    outs = eng.generate(ps, GREEDY)  # all three waiting at once
    assert [o.new_token_ids for o in outs] == cold
    assert outs[0].usage.cached_tokens == 0
    # The others waited a step for the first to compute the shared blocks, then hit them.
    assert all(o.usage.cached_tokens >= (len(system) // 16) * 16 for o in outs[1:])
    assert_no_leak(eng)


def test_pipelined_decode_equals_unpipelined(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    eos = min(tiny_model.eos_token_ids)
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_k=40, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4, logit_bias=((eos, 30.0),)),
        SamplingParams(max_tokens=25, temperature=1.0, seed=3, stop=("e",), ignore_eos=True),
    ]
    ref = engine(tiny_model, pipeline_decode=False).generate(ps, params)
    eng = engine(tiny_model)
    launched_ahead = 0
    original = eng.scheduler.schedule_ahead

    def counting(batch):  # type: ignore[no-untyped-def]
        nonlocal launched_ahead
        queued = original(batch)
        launched_ahead += queued is not None
        return queued

    eng.scheduler.schedule_ahead = counting  # type: ignore[method-assign]
    got = eng.generate(ps, params)
    assert launched_ahead > 5
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in ref]
    assert [o.new_text for o in got] == [o.new_text for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    assert [o.logprobs for o in got][2] is not None
    assert [lp.token_id for lp in got[2].logprobs] == [lp.token_id for lp in ref[2].logprobs]
    assert_no_leak(eng)
    assert not eng.has_step_in_flight  # idle: nothing left holding old pool versions
    # An abort while a step is launched ahead drops its token and frees everything.
    eng.add_request("x", ps[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.has_step_in_flight
    eng.abort("x")
    assert not eng.has_step_in_flight and not eng.step()
    assert_no_leak(eng)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_mlx_lm_architectures_run_unmodified(tiny_model: LoadedModel, arch: str) -> None:
    """mlx-lm's qwen2 (QKV bias) and qwen3 (q/k norms) definitions drive the paged cache unmodified."""
    import dataclasses
    import importlib

    import mlx.nn as nn

    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    args = dict(model_type=arch, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                vocab_size=tiny_model.tokenizer.vocab_size, max_position_embeddings=512, rope_theta=10000.0,
                tie_word_embeddings=False)
    if arch == "qwen3":
        args["head_dim"] = 16
    mx.random.seed(1)
    model = mod.Model(mod.ModelArgs(**args))
    model.update(nn.utils.tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))  # clear margins
    mx.eval(model.parameters())
    loaded = dataclasses.replace(tiny_model, model=model, model_id=f"test-{arch}", num_layers=2, num_kv_heads=2,
                                 head_dim=16, max_model_len=512)
    ps = prompts(tiny_model)[:3]
    eng = LLMEngine(EngineConfig(block_size=16, num_kv_blocks=128), loaded=loaded)
    assert eng.runner.patched_modules == [f"mlx_lm.models.{arch}"]
    got = [list(o.new_token_ids) for o in eng.generate(ps, GREEDY)]
    assert got == [mlx_lm_greedy(loaded, p, GREEDY.max_tokens) for p in ps]
    assert all(len(set(g)) > 2 for g in got)  # a real comparison, not one repeated token
    assert_no_leak(eng)
