"""Llama 4's chunked layers through the engine's seam: the chunked mask `make_mask` builds is registered with its
chunk, so those layers take the paged kernel the self-check chose (the CPU primitive here) with `chunk=`, and
generation equals mlx-lm's own (whose chunked layers use LlamaModel's chunk_mask and ChunkedKVCache)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import mlx.core as mx

import model_zoo as zoo
from trillm.engine.config import EngineConfig
from trillm.engine.kv_cache import PagedKVCache
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import load_model
from trillm.engine.sampling_params import SamplingParams
from trillm.kernels import cpu_ext, selfcheck
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import cpu_supports, paged_attention_cpu

NEW = 12
TOL, RTOL = 1e-3, 1e-4  # as test_model_matrix: fp32 reordering moves logprobs by ~1e-5 relative


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zoo.build("llama4", tmp_path_factory.mktemp("zoo") / "llama4")


def _with_chunk(src: Path, dst: Path, chunk: int) -> Path:
    """The same weights with another attention_chunk_size (one that is no divisor of the block size)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"]["attention_chunk_size"] = chunk
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _mlx_lm_greedy(path: Path, prompt: list[int]) -> tuple[list[int], list[float], float]:
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm_load(str(path))
    tokens, logprobs, margin = [], [], float("inf")
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=NEW, sampler=lambda x: mx.argmax(x, axis=-1)):
        lp = lp.reshape(-1)
        top2 = mx.topk(lp, 2).tolist()
        tokens.append(int(tok))
        logprobs.append(float(lp[int(tok)]))
        margin = min(margin, abs(top2[0] - top2[1]))
    return tokens, logprobs, margin


@pytest.mark.skipif(cpu_ext.load() is None, reason=f"CPU extension unavailable: {cpu_ext.status().reason}")
@pytest.mark.parametrize("chunk, block_size", [(8, 16), (12, 8)], ids=["chunk8-bs16", "chunk12-bs8"])
def test_chunked_layers_run_the_cpu_kernel_and_match_mlx_lm(llama4_dir: Path, tmp_path: Path, chunk: int,
                                                            block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    path = llama4_dir if chunk == zoo.WINDOW else _with_chunk(llama4_dir, tmp_path / "llama4", chunk)
    prompts = [list(zoo.matrix_prompts()[n]) for n in ("long", "ragged")]  # 57 and 23 tokens: several chunks
    refs = [_mlx_lm_greedy(path, p) for p in prompts]
    assert min(r[2] for r in refs) > 0.01, "mlx-lm's greedy choice is a coin toss on this model"

    monkeypatch.setenv(selfcheck.CACHE_ENV, str(tmp_path / "kernel-cache"))
    # Timing on a shared machine is noise: paged attention's kernel is taken as faster, the other ops' not.
    monkeypatch.setattr(selfcheck, "time_kernel", lambda op, *a: {"decode": (0.0, 1.0), "prefill": (0.0, 1.0)}
                        if op.name == "paged_attention" else (1.0, 0.5))  # fmt: skip
    calls: list[tuple[int, int | None, int | None]] = []
    attend = PagedKVCache.attend

    def spy(self: PagedKVCache, queries: mx.array, **kw: Any) -> mx.array:
        calls.append((self.layer, kw.get("chunk"), kw.get("window")))
        return attend(self, queries, **kw)

    monkeypatch.setattr(PagedKVCache, "attend", spy)
    config = EngineConfig(block_size=block_size, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    engine = LLMEngine(config, loaded=load_model(str(path)))

    assert engine.kv_layout is not None
    chunks = [layer.chunk for layer in engine.kv_layout.layers]
    assert chunks == [chunk, chunk, chunk, None]  # every 4th layer attends to the whole context
    head_dim = engine.kv_layout.layers[0].k_dim
    assert cpu_supports(ModelShapes(4, 2, head_dim, block_size, mx.float32)) is None
    pool = engine.runner.pool  # type: ignore[attr-defined]
    for i, c in enumerate(chunks):
        selection = pool.layer_kernels[i]
        assert selection.paged_attention is paged_attention_cpu, selection.report
        assert selection.report.implementation("paged_attention") == "cpu"
    assert pool.layer_kernels[0] is pool.layer_kernels[1] and pool.layer_kernels[0] is not pool.layer_kernels[3]
    assert engine.kernel_report is not None and engine.kernel_report.implementation("paged_attention") == "cpu"

    calls.clear()  # (the load-time probe attended too)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = engine.generate(prompts, params)
    for out, (tokens, logprobs, _) in zip(outs, refs):
        assert list(out.new_token_ids) == tokens
        assert out.logprobs is not None
        for got, want in zip(out.logprobs, logprobs):
            assert abs(got.logprob - want) <= TOL + RTOL * abs(want), (got.logprob, want)
    # Every layer of every forward took the paged kernel (none ran dense), the chunked ones with their chunk.
    assert {layer for layer, _, _ in calls} == {0, 1, 2, 3}
    assert {(layer, c) for layer, c, _ in calls} == {(0, chunk), (1, chunk), (2, chunk), (3, None)}
    assert len(calls) % 4 == 0
