"""A forward queues the graph built so far every few RMSNorms (fused_ops' kicks), so the device computes the
first layers while Python builds the rest: the kicks happen where asked, and change no result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from trillm.engine import model_runner
from trillm.engine.config import EngineConfig
from trillm.engine.fused_ops import fused_ops, install_fused_ops
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import load_model
from trillm.engine.sampling_params import SamplingParams


def test_every_nth_norm_queues_its_input_and_the_logits_do_not_change(tiny_model_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(str(tiny_model_path)).model  # its own copy: installing the fused ops changes it
    install_fused_ops(model)
    tokens = mx.array([[5, 9, 17, 33, 65, 129]])
    with fused_ops():
        plain = model(tokens)
    mx.eval(plain)
    queued: list[tuple[Any, ...]] = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(a), real(*a))[1])
    with fused_ops(kick_every=2):  # 2 layers: 5 norms (2 a layer, then the final one) -> kicks at the 2nd and 4th
        kicked = model(tokens)
    assert len(queued) == 2 and all(len(a) == 1 and a[0].shape == (1, 6, 128) for a in queued)
    with fused_ops():  # no kicks unless asked
        model(tokens)
    assert len(queued) == 2
    np.testing.assert_array_equal(np.array(kicked), np.array(plain))


def test_engine_output_is_the_same_with_kicks_after_every_norm(tiny_model_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def generate() -> list[list[int]]:
        eng = LLMEngine(EngineConfig(kv_cache_memory_gb=0.05), loaded=load_model(str(tiny_model_path)))
        for i in range(3):
            eng.add_request(f"r{i}", [3 + i, 7, 11 * (i + 1), 13], SamplingParams(max_tokens=12, temperature=0.0))
        out: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[f"r{i}"] for i in range(3)]

    monkeypatch.setattr(model_runner, "KICK_EVERY_NORMS", 0)
    want = generate()
    monkeypatch.setattr(model_runner, "KICK_EVERY_NORMS", 1)
    assert generate() == want
