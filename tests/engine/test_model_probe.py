"""The load-time probe (engine/model_probe.py): a paged forward that disagrees with mlx-lm's own forward of the
same model is refused at load in one line; `allow_unverified_model` serves it anyway, flagged; a forward that
crashes is refused the same way; the probe's traffic leaves no statistics behind. Also the seam's own pieces:
the MLA models' paged kernel and the layout read off the model's own caches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import mlx.core as mx

from tests import model_zoo
from trillm.engine.config import EngineConfig
from trillm.engine.errors import UnsupportedModel, UnverifiedModel
from trillm.engine.kv_cache import PagedKVCache
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel, load_model
from trillm.engine.paged_model import kv_layout

CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(model_zoo.build("gemma3_text", tmp_path_factory.mktemp("gemma3") / "m")))


def test_a_sound_model_is_verified_and_its_probe_leaves_no_trace(gemma3: LoadedModel) -> None:
    engine = LLMEngine(CONFIG, loaded=gemma3)
    result = engine.probe_result
    assert result is not None and result.verified and not result.allowed_anyway
    assert result.tokens_compared > 40 and result.max_logprob_diff < 5e-3
    # one probe prompt is longer than the model's sliding window, so the window was exercised
    assert max(result.prompt_lengths) > max(w for w in engine.kv_layout.windows if w)  # type: ignore[union-attr]
    stats = engine.statistics()
    assert stats.num_prompt_tokens == stats.num_generation_tokens == stats.prefix_cache_queries == 0
    assert stats.num_blocks_used == 0 and not engine.has_unfinished_requests()


def test_a_planted_seam_bug_is_refused_at_load_in_one_line(gemma3: LoadedModel,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The bug this guards against: a seam that drops each layer's sliding window (every layer attends to everything).
    original = PagedKVCache.known_mask

    def windowless(self: PagedKVCache, mask: object) -> tuple[bool, int | None, int | None]:
        plain, _, chunk = original(self, mask)
        return plain, None, chunk

    monkeypatch.setattr(PagedKVCache, "known_mask", windowless)
    with pytest.raises(UnverifiedModel) as info:
        LLMEngine(CONFIG, loaded=gemma3)
    message = str(info.value)
    assert "\n" not in message and "sliding window" in message and "mlx-lm" in message
    assert "--allow-unverified-model" in message


def test_allow_unverified_model_serves_it_flagged(gemma3: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    original = PagedKVCache.known_mask
    monkeypatch.setattr(PagedKVCache, "known_mask", lambda self, mask: (original(self, mask)[0], None, None))
    engine = LLMEngine(dataclasses.replace(CONFIG, allow_unverified_model=True), loaded=gemma3)
    result = engine.probe_result
    assert result is not None and not result.verified and result.allowed_anyway
    assert result.max_logprob_diff > 0.02


def test_a_crashing_forward_is_refused_not_a_traceback_later(gemma3: LoadedModel,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: PagedKVCache, *args: object, **kwargs: object) -> mx.array:
        raise ValueError("planted kernel failure")

    monkeypatch.setattr(PagedKVCache, "attend", broken)
    with pytest.raises(UnverifiedModel, match="planted kernel failure"):
        LLMEngine(CONFIG, loaded=gemma3)


def test_no_probe_when_disabled(gemma3: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PagedKVCache, "known_mask", lambda self, mask: (True, None, None))
    engine = LLMEngine(dataclasses.replace(CONFIG, verify_model=False), loaded=gemma3)
    assert engine.probe_result is None


def test_layout_comes_from_the_models_own_caches(gemma3: LoadedModel, tmp_path: Path) -> None:
    layout = kv_layout(gemma3.model, "gemma3")
    window = gemma3.model.args.sliding_window
    assert layout.windows == tuple(window if i % 2 == 0 else None for i in range(len(layout.windows)))
    gemma4 = load_model(str(model_zoo.build("gemma4_text", tmp_path / "g4")))
    shapes = {(lay.num_kv_heads, lay.k_dim) for lay in kv_layout(gemma4.model, "gemma4").layers}
    assert len(shapes) > 1  # global layers have their own head dim
    assert len(kv_layout(gemma4.model, "gemma4").layers) < len(gemma4.model.layers)  # shared-KV layers have none


def test_unchecked_recurrent_models_are_refused_at_load_in_one_line(tmp_path: Path) -> None:
    # Hybrids and Mamba-2 are served (their recurrent state in engine/state_pool.py) and pass the probe; a
    # recurrent family the matrix does not check (Mamba-1) is refused by name.
    mamba2 = LLMEngine(CONFIG, loaded=load_model(str(model_zoo.build("mamba2", tmp_path / "m2"))))
    assert mamba2.probe_result is not None and mamba2.probe_result.verified
    path = model_zoo.build("mamba", tmp_path / "m1", check_margin=False)
    with pytest.raises(UnsupportedModel) as info:
        LLMEngine(CONFIG, loaded=load_model(str(path)))
    assert "\n" not in str(info.value) and "recurrent" in str(info.value)


def test_mla_runs_the_paged_mla_kernel_and_matches_mlx_lm(tmp_path: Path) -> None:
    family = model_zoo.FAMILY["deepseek_v3"]
    wide = model_zoo.Family(family.name, family.model_type, family.attention,
                            {**family.config, "qk_rope_head_dim": 16, "kv_lora_rank": 32})
    lm = load_model(str(model_zoo.build(wide, tmp_path / "ds")))
    engine = LLMEngine(CONFIG, loaded=lm)
    assert engine.runner.attention_variants == ["mlx_lm.models.deepseek_v3.DeepseekV3Attention x2"]  # type: ignore[attr-defined]
    assert engine.probe_result is not None and engine.probe_result.verified
    assert engine.kernel_report is not None
    impl = engine.kernel_report.implementations()["mla_attention"]
    from trillm.kernels import cpu_ext

    assert impl == ("cpu" if cpu_ext.load() is not None else "reference")


def test_tensor_parallel_refuses_what_its_uniform_pool_cannot_hold(tmp_path: Path) -> None:
    from trillm.engine.tp_runner import TensorParallelError, check_shardable

    gpt_oss = load_model(str(model_zoo.build("gpt_oss", tmp_path / "go")))  # mlx-lm can shard it; windows
    with pytest.raises(TensorParallelError, match="RotatingKVCache"):
        check_shardable(gpt_oss.model, "gpt_oss", 2)
    deepseek = load_model(str(model_zoo.build("deepseek_v3", tmp_path / "ds")))  # MLA: K and V differ
    with pytest.raises(TensorParallelError, match="DeepseekV3Attention"):
        check_shardable(deepseek.model, "deepseek_v3", 2)
    llama = load_model(str(model_zoo.build("llama", tmp_path / "ll")))
    check_shardable(llama.model, "llama", 2)


def test_recurrent_families_outside_the_checked_list_are_refused_by_name(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from trillm.engine import paged_model

    path = model_zoo.build("lfm2", tmp_path / "lfm2")
    load_model(str(path))  # checked: loads
    monkeypatch.setattr(paged_model, "VERIFIED_RECURRENT", frozenset({"qwen3_next"}))
    with pytest.raises(UnsupportedModel) as info:
        load_model(str(path))
    assert "\n" not in str(info.value) and "lfm2 has recurrent layers" in str(info.value)
