"""--kv-cache-dtype: the pool's dtype, its bytes per block, and generation over an int8 cache.

The int8 cache is lossy: its output is compared with the float32 cache's (prompt logprobs within a bound,
greedy tokens mostly equal), and its exact parts are exact: the block bytes the engine sizes the pool by
are the pool's arrays' bytes, and a pool grown across slabs generates what one allocated up front does.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from trillm.engine.config import KV_CACHE_DTYPES, EngineConfig
from trillm.engine.errors import InvalidRequest, ModelLoadError
from trillm.engine.kv_cache import KVLayout, KVPool
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SCORE = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)


def engine(model: LoadedModel, kv: str, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(block_size=16, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=128,
                                  verify_model=False, kv_cache_dtype=kv)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=model)  # type: ignore[arg-type]


def prompts(model: LoadedModel) -> list[list[int]]:
    texts = ["the quick brown fox jumps over the lazy dog " * 6, "once upon a time there was " * 8,
             "0123456789 " * 12, "hello world " * 10]
    return [model.tokenizer.encode(t) for t in texts]


def prompt_logprobs(eng: LLMEngine, ps: list[list[int]]) -> list[np.ndarray]:
    outs = eng.generate(ps, SCORE)
    return [np.array([e.logprob for e in o.prompt_logprobs[1:]]) for o in outs]  # type: ignore[union-attr]


@pytest.mark.parametrize("kv", list(KV_CACHE_DTYPES))
def test_block_bytes_are_the_pools_bytes(tiny_model: LoadedModel, kv: str) -> None:
    eng = engine(tiny_model, kv)
    pool: KVPool = eng.runner.pool  # type: ignore[attr-defined]
    layout = eng.kv_layout
    assert layout is not None and layout.kv_dtype == (KV_CACHE_DTYPES[kv] or "float32")
    assert pool.keys[0].dtype == (mx.uint8 if kv == "int4" else getattr(mx, layout.kv_dtype))
    blocks = pool.keys[0].shape[0]
    assert pool.nbytes == blocks * eng._bytes_per_block == blocks * layout.bytes_per_block(16, tiny_model.dtype)
    lay = layout.layers[0]
    per_token_head = {"auto": 8 * lay.k_dim, "fp32": 8 * lay.k_dim, "fp16": 4 * lay.k_dim, "bf16": 4 * lay.k_dim,
                      "int8": 2 * lay.k_dim + 8,  # K + V; int8: one float32 scale each
                      "int4": lay.k_dim + 2 * 8 * max(1, lay.k_dim // 32)}[kv]  # int4: (scale, min) per group
    assert eng._bytes_per_block == 16 * len(layout.layers) * lay.num_kv_heads * per_token_head
    assert eng.statistics().kv_pool_bytes == pool.nbytes


def test_int8_cache_generates_close_to_float32(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    ref, q8 = engine(tiny_model, "fp32"), engine(tiny_model, "int8")
    assert q8.kernel_report is not None and q8.kernel_report.implementation("paged_attention") in ("cpu", "reference")
    deltas = np.concatenate([np.abs(a - b) for a, b in zip(prompt_logprobs(ref, ps), prompt_logprobs(q8, ps))])
    assert deltas.size > 200
    # Rounding each K/V to 8 bits moves logprobs a little, never wildly (a broken scale moves them by units).
    assert float(deltas.mean()) < 0.05 and float(deltas.max()) < 0.3, (deltas.mean(), deltas.max())
    assert float(deltas.max()) > 0  # quantized: not the float32 cache by accident
    want = [o.new_token_ids for o in ref.generate(ps, GREEDY)]
    got = [o.new_token_ids for o in q8.generate(ps, GREEDY)]
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    assert same >= 0.75 * sum(map(len, want)), (same, want, got)


def test_int4_cache_generates_what_the_reference_quantization_does(tiny_model: LoadedModel) -> None:
    """The engine over an int4 pool against attention written out by hand over the same quantization: the
    model's forward with every cached K/V rounded by quantize_int4 / dequantize_int4 (mlx-lm's own cache)."""
    from mlx_lm.models.cache import KVCache

    from trillm.kernels.kv_write import dequantize_int4, quantize_int4

    class RoundedCache(KVCache):
        def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
            def rt(x: mx.array) -> mx.array:
                return dequantize_int4(*quantize_int4(x), x.dtype)

            return super().update_and_fetch(rt(keys), rt(values))  # type: ignore[no-any-return]

    ps = prompts(tiny_model)
    q4 = engine(tiny_model, "int4")
    assert q4.kernel_report is not None and q4.kernel_report.implementation("paged_attention") == "cpu"
    got = [o.new_token_ids for o in q4.generate(ps, GREEDY)]
    for p, g in zip(ps, got):
        cache = [RoundedCache() for _ in tiny_model.model.layers]
        ids, want = list(p), []
        logits = tiny_model.model(mx.array([ids]), cache=cache)
        for _ in range(len(g)):
            nxt = int(mx.argmax(logits[0, -1]))
            want.append(nxt)
            logits = tiny_model.model(mx.array([[nxt]]), cache=cache)
        assert list(g) == want
    ref = engine(tiny_model, "fp32")
    deltas = np.concatenate([np.abs(a - b) for a, b in zip(prompt_logprobs(ref, ps), prompt_logprobs(q4, ps))])
    assert float(deltas.max()) > 0 and float(deltas.mean()) < 0.5, (deltas.mean(), deltas.max())


def test_fp16_cache_generates_close_to_float32(tiny_model: LoadedModel) -> None:
    ps = prompts(tiny_model)
    deltas = np.concatenate([np.abs(a - b) for a, b in zip(prompt_logprobs(engine(tiny_model, "fp32"), ps),
                                                           prompt_logprobs(engine(tiny_model, "fp16"), ps))])
    assert float(deltas.max()) < 0.05, deltas.max()


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_a_quantized_pool_grown_across_slabs_generates_what_one_big_pool_does(tiny_model: LoadedModel,
                                                                              kv: str) -> None:
    big = engine(tiny_model, kv, num_kv_blocks=256, kv_slab_mb=1024)
    small = engine(tiny_model, kv, num_kv_blocks=256, kv_slab_mb=0.0625)
    cap = small.pool_capacity
    assert cap is not None and cap.capacity == cap.slab_blocks < 256
    want = [o.new_token_ids for o in big.generate(prompts(tiny_model), GREEDY)]
    got = [o.new_token_ids for o in small.generate(prompts(tiny_model), GREEDY)]
    assert got == want and cap.num_grows >= 1
    pool: KVPool = small.runner.pool  # type: ignore[attr-defined]
    assert all(a.shape[0] == cap.capacity for a in pool.keys + pool.values + pool.key_scales + pool.value_scales)
    # Idle: the pool shrinks, the kept blocks (and their scales) renamed; a prefix hit still generates the same.
    small.release_idle_memory()
    again = small.generate(prompts(tiny_model)[-1:], GREEDY)[0]
    assert again.new_token_ids == want[-1]
    assert all(a.shape[0] == cap.capacity for a in pool.key_scales + pool.value_scales)


def test_quantized_caches_are_refused_where_no_kernel_serves_them(tiny_model: LoadedModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from trillm.engine.llm_engine import with_kv_dtype
    from trillm.engine.paged_model import kv_layout

    with pytest.raises(InvalidRequest, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int2")
    import trillm.kernels.backend as backend

    layout = kv_layout(tiny_model.model, tiny_model.name)
    for gpu in ("metal", "cuda"):  # int8 and int4 have Metal/CUDA variants (the start-up self-check decides)
        monkeypatch.setattr(backend, "kernel_backend", lambda gpu=gpu: gpu)
        for kv in ("int8", "int4"):
            assert with_kv_dtype(layout, EngineConfig(kv_cache_dtype=kv), tiny_model).kv_dtype == kv
    monkeypatch.setattr(backend, "kernel_backend", lambda: None)  # no kernel back-end at all (TRILLM_KERNELS=ref)
    for kv in ("int8", "int4"):
        with pytest.raises(ModelLoadError, match=f"{kv} runs on CPU, Metal and CUDA only"):
            engine(tiny_model, kv)


def test_layout_sizes_each_kv_dtype() -> None:
    layout = KVLayout.uniform(2, 4, 64)
    assert layout.bytes_per_block(16, mx.float32) == 16 * 2 * 4 * 128 * 4
    assert KVLayout(layout.layers, kv_dtype="float16").bytes_per_block(16, mx.float32) == 16 * 2 * 4 * 128 * 2
    assert KVLayout(layout.layers, kv_dtype="int8").bytes_per_block(16, mx.float32) == 16 * 2 * 4 * (128 + 8)
    # int4: 64 bytes of K and V values per head, (scale, min) float32 for each of 2 groups of 32, K and V
    assert KVLayout(layout.layers, kv_dtype="int4").bytes_per_block(16, mx.float32) == 16 * 2 * 4 * (64 + 32)


def test_the_mock_sizes_its_blocks_by_the_flag() -> None:
    from trillm.engine.mock import MockModelSpec, make_mock_engine

    spec = MockModelSpec(name="m", vocab_size=100, max_model_len=256)
    fp32 = make_mock_engine(EngineConfig(num_kv_blocks=8), spec=spec)
    q8 = make_mock_engine(EngineConfig(num_kv_blocks=8, kv_cache_dtype="int8"), spec=spec)
    assert fp32._bytes_per_block > 3 * q8._bytes_per_block > 0
