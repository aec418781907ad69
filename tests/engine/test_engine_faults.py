"""Whatever one request raises while its output is produced fails that request alone; ids past the
tokenizer's vocabulary (padded embeddings) are never sampled and never break decoding."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import pytest

from trillm.engine.config import EngineConfig
from trillm.engine.detokenizer import IncrementalDetokenizer
from trillm.engine.llm_engine import REQUEST_FAILED, LLMEngine
from trillm.engine.loader import load_model
from trillm.engine.mock import MockModelSpec, MockTokenizer, make_mock_engine
from trillm.engine.outputs import FinishReason, RequestOutput
from trillm.engine.sampling_params import SamplingParams

POISON = 7  # a token id whose text the tokenizer below cannot produce


class PoisonedTokenizer(MockTokenizer):
    """Decoding any window that holds POISON raises, like a tokenizer bug that one prompt triggers."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if POISON in ids:
            raise RuntimeError("decoder exploded")
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


def run_to_end(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the requests never finished")


def test_a_request_whose_detokenizing_raises_fails_alone() -> None:
    tok = PoisonedTokenizer(500)
    engine = make_mock_engine(EngineConfig(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64),
                              spec=MockModelSpec(name="m", vocab_size=500, max_model_len=512), tokenizer=tok)
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop=("zz",))
    engine.add_request("good-1", [10, 11, 12], params)
    engine.add_request("bad", [10, POISON, 12], params)
    engine.add_request("good-2", [13, 14] * 20, params)
    outs = run_to_end(engine)
    bad = outs["bad"][-1]
    assert bad.finish_reason is FinishReason.ERROR and bad.error == REQUEST_FAILED
    assert "exploded" not in (bad.error or "")  # the cause is logged, not handed to the client
    for rid in ("good-1", "good-2"):
        merged = RequestOutput.concat(outs[rid])
        assert merged.finish_reason is FinishReason.LENGTH and len(merged.new_token_ids) == 20
    st = engine.statistics()
    assert st.num_running == st.num_waiting == 0 and st.num_blocks_used == 0
    engine.block_manager.check_invariants([])


def test_ids_past_the_vocabulary_decode_to_no_text() -> None:
    tok = MockTokenizer(100)
    detok = IncrementalDetokenizer(tok, [5, 6, 100 + 3])
    text = detok.add(10) + detok.add(100) + detok.add(10**6) + detok.add(-1) + detok.add(11) + detok.flush()
    assert text == tok.decode([10, 11])


def padded_copy(src: Path, dst: Path, pad: int) -> Path:
    """The tiny model with `pad` extra embedding and output rows (as GPU-friendly checkpoints pad their vocab),
    the padding's logits made the largest, so an unmasked sampler would always pick one of them."""
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    assert isinstance(weights, dict)
    head, embed = weights["lm_head.weight"], weights["model.embed_tokens.weight"]
    hidden = head.shape[1]
    weights["lm_head.weight"] = mx.concatenate([head, mx.full((pad, hidden), 50.0)], axis=0)
    weights["model.embed_tokens.weight"] = mx.concatenate([embed, mx.zeros((pad, hidden))], axis=0)
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] += pad
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_vocab_ids_are_never_sampled(tiny_model_path: Path, tmp_path: Path, temperature: float) -> None:
    model = load_model(str(padded_copy(tiny_model_path, tmp_path / "padded", pad=64)))
    vocab = model.tokenizer.vocab_size
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64), loaded=model)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=1, ignore_eos=True, logprobs=True,
                            top_logprobs=3)
    (out,) = engine.generate([model.tokenizer.encode("hello there")], params)
    assert len(out.new_token_ids) == 12 and all(0 <= t < vocab for t in out.new_token_ids)
    assert out.logprobs is not None
    assert all(0 <= tid < vocab for lp in out.logprobs for tid, _ in lp.top)
