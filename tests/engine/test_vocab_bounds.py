"""Token ids are bounded by the LM head's rows as well as the tokenizer: a model whose tokenizer gained tokens
without a resized embedding (more ids than logits) refuses those ids cleanly instead of reading past the
embedding or the logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel, load_model
from trillm.engine.sampling_params import SamplingParams

from tiny_model import build_tiny_model

EXTRA = [f"<extra_{i}>" for i in range(8)]


@pytest.fixture(scope="module")
def unresized_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer as RustTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("models") / "unresized", seed=1)
    tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(EXTRA)  # the tokenizer grows; config.json and the weights do not
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def unresized(unresized_path: Path) -> LoadedModel:
    return load_model(str(unresized_path))


def test_the_logits_rows_bound_every_token_id(unresized: LoadedModel, unresized_path: Path) -> None:
    rows = json.loads((unresized_path / "config.json").read_text())["vocab_size"]
    assert unresized.vocab_size == rows == unresized.model.lm_head.weight.shape[0]
    assert unresized.tokenizer.vocab_size == rows + len(EXTRA)
    eng = LLMEngine(EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64),
                    loaded=unresized)
    assert eng.limits.vocab_size == rows
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    added = unresized.tokenizer.encode("hello <extra_3>")  # text that encodes to an id past the head
    assert max(added) >= rows
    with pytest.raises(InvalidRequest, match=rf"\[0, {rows}\).*got {max(added)}"):
        eng.add_request("added", added, greedy)
    with pytest.raises(InvalidRequest, match=rf"\[0, {rows}\)"):
        eng.add_request("raw", [5, 6, rows], greedy)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        eng.add_request("bias", [5, 6], SamplingParams(max_tokens=4, logit_bias=((rows + 2, 100.0),)))
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        eng.add_request("stop", [5, 6], SamplingParams(max_tokens=4, stop_token_ids=(rows,)))
    # The last row is fine, and the engine serves on after the refusals.
    (out,) = eng.generate([[5, 6, rows - 1]], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True,
                                                                logit_bias=((rows - 1, 5.0),)))
    assert len(out.new_token_ids) == 6 and all(0 <= t < rows for t in out.new_token_ids)
    assert not eng.has_unfinished_requests()


def test_an_unknown_head_size_falls_back_to_the_tokenizer(unresized: LoadedModel) -> None:
    import dataclasses

    eng = LLMEngine(EngineConfig(block_size=16, num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=32),
                    loaded=dataclasses.replace(unresized, vocab_size=0))
    assert eng.limits.vocab_size == unresized.tokenizer.vocab_size
