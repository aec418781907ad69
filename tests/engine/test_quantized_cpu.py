"""Quantized GGUF files stay quantized on CPU (the default) and decode greedily exactly as their dequantized
float32 load does (`--dtype float32`, the reference), through the whole engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from test_gguf_families import _BASE, FAMILIES, build_folder, random_blocks, to_gguf, tokenizer_json  # noqa: F401
from trillm.engine.config import EngineConfig
from trillm.engine.fused_ops import quantization_formats
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel, load_model
from trillm.engine.model_runner import ModelRunner
from trillm.engine.sampling_params import SamplingParams
from trillm.kernels import cpu_ext

TEXTS = ["hello there", "the quick brown fox jumps over the lazy dog " * 3, "0123456789 " * 4]
# (bits, group, scales dtype) each GGUF type is held in
FORMATS = {Q.Q4_0: (4, 32, "float16"), Q.Q4_1: (4, 32, "float16"), Q.Q8_0: (8, 32, "float16"),
           Q.Q4_K: (4, 32, "float32")}


def _greedy(loaded: LoadedModel, n: int = 16) -> list[list[int]]:
    eng = LLMEngine(EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256),
                    loaded=loaded)
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.new_token_ids) for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_quantized_gguf_decodes_as_its_dequantized_load(qtype: Q, tokenizer_json: Path, tmp_path: Path) -> None:
    arch, extra = FAMILIES["llama"]
    config: dict[str, Any] = {**_BASE, **extra}
    if qtype == Q.Q4_K:  # K-quant rows are super-blocks of 256
        config |= {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    folder = build_folder(tmp_path / "tiny", config, tokenizer_json)
    rng = np.random.default_rng(int(qtype))

    def type_for(name: str, value: np.ndarray) -> Q | tuple[Q, np.ndarray]:
        if value.ndim != 2:
            return Q.F32
        if qtype == Q.Q4_K:
            scale = 0.4 if "embd" in name or "output" in name else 0.05
            return qtype, random_blocks(qtype, *value.shape, rng, scale=scale)
        return qtype

    path = to_gguf(folder, tmp_path / f"tiny.{qtype.name}.gguf", arch, tokenizer_json, type_for)
    kept, dense = load_model(str(path)), load_model(str(path), dtype="float32")
    # The embedding's scales are float32 (its lookups dequantize in their dtype), the layers' as stored.
    bits, group, scales = FORMATS[qtype]
    assert kept.dtype == mx.float32 and set(quantization_formats(kept.model)) == {FORMATS[qtype], (bits, group, "float32")}
    assert sum(isinstance(m, nn.QuantizedLinear) for _, m in kept.model.named_modules()) == 2 * 7 + 1
    assert quantization_formats(dense.model) == ()
    assert kept.num_bytes < dense.num_bytes / 2.5
    got, want = _greedy(kept), _greedy(dense)
    assert got == want
    assert len({t for seq in want for t in seq}) > 6  # not a degenerate echo


@pytest.mark.skipif(cpu_ext.load() is None, reason="trillm's CPU extension is unavailable")
def test_quantized_layers_run_the_cpu_primitive(tokenizer_json: Path, tmp_path: Path) -> None:
    arch, extra = FAMILIES["llama"]
    folder = build_folder(tmp_path / "tiny", {**_BASE, **extra}, tokenizer_json)
    loaded = load_model(str(to_gguf(folder, tmp_path / "tiny.Q4_1.gguf", arch, tokenizer_json, lambda n, v: Q.Q4_1 if v.ndim == 2 else Q.F32)))
    eng = LLMEngine(EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4), loaded=loaded)
    report = {r.op: r for r in eng.kernel_report.ops}["quant_linear"]
    assert report.reason != "not used by this model" and not report.failed


@pytest.mark.skipif(cpu_ext.load() is None, reason="trillm's CPU extension is unavailable")
def test_position_logits_of_a_quantized_head_run_the_kernels(tokenizer_json: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Speculative verification and prompt logprobs take the head over several positions after the forward;
    # outside the forward's kernels a quantized head ran MLX's own quantized matmul (8x a verify's cost).
    arch, extra = FAMILIES["llama"]
    folder = build_folder(tmp_path / "tiny", {**_BASE, **extra}, tokenizer_json)
    loaded = load_model(str(to_gguf(folder, tmp_path / "tiny.Q4_1.gguf", arch, tokenizer_json,
                                    lambda n, v: Q.Q4_1 if v.ndim == 2 else Q.F32)))
    eng = LLMEngine(EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4), loaded=loaded)
    runner = eng.runner
    assert isinstance(runner, ModelRunner)
    hidden = mx.random.normal((1, 5, _BASE["hidden_size"]), key=mx.random.key(3))
    want = runner.head.logits(hidden)  # MLX's own quantized matmul
    mx.eval(want)
    calls = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = runner.position_logits(hidden)
    mx.eval(got)
    assert calls == []
    assert got.shape == want.shape and mx.allclose(got, want, rtol=1e-3, atol=1e-3).item()


@pytest.mark.slow
def test_default_model_q4_1_kept_decodes_as_dequantized() -> None:
    kept, dense = load_model(None), load_model(None, dtype="float32")
    assert (4, 32, "float16") in quantization_formats(kept.model)  # Q4_1
    assert kept.num_bytes < dense.num_bytes / 4
    assert _greedy(kept, 8) == _greedy(dense, 8)


def test_dequantized_matmuls_equal_mlx_quantized_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the load-time probe's mlx-lm forward runs on CPU: dequantized weights, a slice of output rows at a
    # time (four slices here), for calls of enough rows; one row, and code outside the block, keep MLX's own.
    from trillm.engine import fused_ops

    holder = nn.Module()
    holder.lin = nn.QuantizedLinear(64, 40, bias=True, group_size=32, bits=4)
    holder.emb = nn.QuantizedEmbedding(40, 64, group_size=32, bits=4)
    fused_ops.install_fused_ops(holder)
    lin, emb = holder.lin, holder.emb
    assert isinstance(lin, fused_ops.FusedQuantizedLinear) and isinstance(emb, fused_ops.FusedQuantizedEmbedding)
    monkeypatch.setattr(fused_ops, "DEQUANTIZE_ELEMENTS", 10 * 64)
    x = mx.random.normal((2, 3, 64), key=mx.random.key(5))
    want = (lin(x), emb.as_linear(x))
    calls: list[int] = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    with fused_ops.dequantized_matmuls():
        got = (lin(x), emb.as_linear(x))
        assert calls == []
        lin(x[:1, :1]), emb.as_linear(x[:1, :1])
        assert len(calls) == 2  # under DEQUANTIZE_MIN_ROWS rows
    lin(x)
    assert len(calls) == 3
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and mx.allclose(g, w, rtol=1e-5, atol=1e-5).item()
