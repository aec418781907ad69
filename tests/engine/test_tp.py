"""Tensor parallelism over mx.distributed (ring over loopback): a sharded group's greedy outputs equal one
rank's, the plan codec round-trips, and models that cannot shard are refused with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tp_harness import KINDS, greedy, scenarios
from trillm.engine.config import EngineConfig
from trillm.engine.distributed import TensorParallelError
from trillm.engine.kv_cache import BatchLayout
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.model_runner import ForwardInputs
from trillm.engine.tp_runner import (
    HEADER, MIN_CAPACITY, check_shardable, decode_forward, encode_forward, forward_message_size,
)

HARNESS = Path(__file__).with_name("tp_harness.py")
LOGPROB_TOL = 1e-4  # fp32: the sharded matmuls sum their partial products in another order


def run_tp(size: int, config: EngineConfig, prompts: list[list[int]], max_tokens: int, tmp_path: Path,
           kinds: tuple[str, ...] = (*KINDS, "ahead")) -> Any:
    out = tmp_path / f"tp{size}.json"
    fields = {k: getattr(config, k) for k in config.__dataclass_fields__}
    subprocess.run([sys.executable, str(HARNESS), str(size), json.dumps(fields), json.dumps(prompts),
                    str(max_tokens), ",".join(kinds), str(out)], check=True, timeout=900)
    return json.loads(out.read_text())


def assert_same_outputs(tp: Any, ref: Any) -> None:
    assert set(tp) >= set(ref)
    for scenario in ref:
        assert len(tp[scenario]) == len(ref[scenario])
        for i, (a, b) in enumerate(zip(tp[scenario], ref[scenario])):
            assert a["tokens"] == b["tokens"], (scenario, i)
            assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= LOGPROB_TOL, (scenario, i)
            for top_a, top_b in zip(a["top"], b["top"]):
                assert max(abs(x[1] - y[1]) for x, y in zip(top_a, top_b)) <= LOGPROB_TOL
                assert [t for t, _ in top_a] == [t for t, _ in top_b] or _near_tie(top_b)


def _near_tie(top: list[list[float]]) -> bool:
    return any(abs(top[j][1] - top[j + 1][1]) <= 2 * LOGPROB_TOL for j in range(len(top) - 1))


def tiny_prompts(model: LoadedModel) -> list[list[int]]:
    enc = model.tokenizer.encode
    long = [enc(f"{t} " * 120)[:600] for t in ("the quick brown fox", "once upon a time", "hello world 123",
                                                 "café naïve résumé")]
    return [enc("hello"), enc("a b c"), *long, enc("0123456789 " * 6)]


def test_two_ranks_equal_one_rank(tiny_model_path: Path, tiny_model: LoadedModel, tmp_path: Path) -> None:
    """Greedy tokens and logprobs, batched / one at a time / arriving mid-decode (so one step holds decodes
    and prefill chunks in several forwards); launch-ahead decode on; four 600-token prompts in one forward
    overflow the plan's first collective; an engine rebuilt on the same group (as after a failure) serves on."""
    # kernels="ref": the references on every rank, skipping each rank's start-up kernel self-check (at a
    # 4096-token chunk it would take longer than the test)
    config = EngineConfig(model=str(tiny_model_path), block_size=16, num_kv_blocks=512, max_num_seqs=8,
                          max_num_batched_tokens=4096, kernels="ref")
    prompts = tiny_prompts(tiny_model)
    tp = run_tp(2, config, prompts, 10, tmp_path)
    ref = scenarios(LLMEngine(config, loaded=tiny_model), prompts, greedy(10))
    assert_same_outputs(tp, ref)
    assert tp["plan_overflows"] >= 1 and tp["launched_ahead"]
    assert tp["worker_exits"] == [] and tp["worker_codes"] == [0]  # alive throughout, then stopped cleanly


def test_two_ranks_with_an_int8_cache_equal_one_rank(tiny_model_path: Path, tiny_model: LoadedModel,
                                                     tmp_path: Path) -> None:
    """--kv-cache-dtype int8 reaches every rank's pool: each KV head is quantized on its own (one scale per
    token and head), so a rank holding half the heads writes and reads what one rank does."""
    config = EngineConfig(model=str(tiny_model_path), block_size=16, num_kv_blocks=256, max_num_seqs=4,
                          max_num_batched_tokens=512, kernels="ref", kv_cache_dtype="int8")
    prompts = tiny_prompts(tiny_model)[:4]
    tp = run_tp(2, config, prompts, 6, tmp_path, kinds=("batched",))
    single = LLMEngine(config, loaded=tiny_model)
    assert single.runner.pool.keys[0].dtype == mx.int8  # type: ignore[attr-defined]
    assert_same_outputs(tp, scenarios(single, prompts, greedy(6), kinds=("batched",)))


@pytest.mark.slow
def test_smollm2_over_three_ranks_equals_one_rank(default_model: LoadedModel, tmp_path: Path) -> None:
    tok = default_model.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name a colour.")]
    # 3 ranks on 2 cores, each busy-waiting in 61 collectives a step: keep it to one batch of a few steps (the
    # other scenarios run on the tiny model above), skip the kernel self-check on every rank and the load-time
    # probe (~20 s here; the tiny model's cases above run it over ranks)
    config = EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, kernels="ref",
                          verify_model=False)
    kinds = ("batched",)
    tp = run_tp(3, config, prompts, 3, tmp_path, kinds)
    ref = scenarios(LLMEngine(config, loaded=default_model), prompts, greedy(3), kinds)
    assert_same_outputs(tp, ref)
    assert tok.decode(tp["batched"][0]["tokens"]) == "The capital of"


def _llama(heads: int, kv_heads: int, ffn: int) -> Any:
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs(model_type="llama", hidden_size=heads * 8, num_hidden_layers=1,
                                       intermediate_size=ffn, num_attention_heads=heads, rms_norm_eps=1e-5,
                                       vocab_size=32, num_key_value_heads=kv_heads))


def test_models_whose_heads_do_not_divide_are_refused() -> None:
    smollm2 = _llama(9, 3, 1536)  # SmolLM2-135M's head counts
    with pytest.raises(TensorParallelError, match=r"SmolLM2 cannot be split over 2 ranks: its 9 query heads and "
                                                  r"3 KV heads do not divide by 2 \(--tensor-parallel 3 would\)"):
        check_shardable(smollm2, "SmolLM2", 2)
    check_shardable(smollm2, "SmolLM2", 3)
    with pytest.raises(TensorParallelError, match="its 6 KV heads do not divide by 4"):
        check_shardable(_llama(8, 6, 64), "m", 4)
    with pytest.raises(TensorParallelError, match="implements no shard"):
        check_shardable(object(), "m", 2)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 7), st.booleans(), st.integers(0, 10_000))
def test_plan_round_trips(B: int, L: int, W: int, uniform: bool, seed: int) -> None:
    mx.random.seed(seed)
    ints = lambda *shape: mx.random.randint(0, 50_000, shape).astype(mx.int32)  # noqa: E731
    layout = BatchLayout(block_tables=ints(B, W), context_lens=ints(B), slot_mapping=ints(B * L), offsets=ints(B),
                         max_context_len=777, uniform_offset=5 if uniform else None, num_new_tokens=L)
    inputs = ForwardInputs(ints(B, L), layout, ints(B))
    flat = encode_forward(inputs)
    assert flat.shape == (forward_message_size(B, L, W),)
    padded = mx.concatenate([flat, mx.zeros((MIN_CAPACITY,), mx.int32)])  # a receiver's buffer is longer
    got = decode_forward(flat[:HEADER].tolist(), padded)
    assert got.tokens.tolist() == inputs.tokens.tolist() and got.last_index.tolist() == inputs.last_index.tolist()
    for name in ("block_tables", "context_lens", "slot_mapping", "offsets"):
        assert getattr(got.layout, name).tolist() == getattr(layout, name).tolist(), name
    assert (got.layout.max_context_len, got.layout.uniform_offset, got.layout.num_new_tokens) == (777, layout.uniform_offset, L)


def test_one_rank_never_touches_tensor_parallelism(tiny_model_path: Path) -> None:
    """The single-rank engine runs the plain ModelRunner and never loads the distributed modules."""
    code = f"""
import sys
import trillm.kernels
from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.model_runner import ModelRunner
from trillm.engine.sampling_params import SamplingParams
eng = LLMEngine(EngineConfig(model={str(tiny_model_path)!r}, num_kv_blocks=64, kernels="ref"))
eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
assert type(eng.runner) is ModelRunner, type(eng.runner)
loaded = [m for m in ("trillm.engine.tp_runner", "trillm.engine.distributed", "trillm.engine.tp_worker") if m in sys.modules]
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
