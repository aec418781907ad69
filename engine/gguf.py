"""Load llama-family GGUF files into mlx-lm's llama model, with a tokenizer rebuilt from the metadata.

mx.load reads GGUF natively (Q4_0/Q4_1/Q8_0 arrive as MLX affine-quantized weight/scales/biases triples,
other quantizations as float16), but it trusts the file: a truncated file can crash the process. So the
header and every tensor's extent are first checked in pure Python (`validate_gguf`).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from trillm.engine.errors import CorruptModelFile
from trillm.engine.gguf_tokenizer import build_gguf_tokenizer
from trillm.engine.tokenizer import Tokenizer

# ggml tensor type -> (name, elements per block, bytes per block); from ggml.h / gguf docs.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}
# GGUF metadata value type -> struct format of one scalar (8: string, 9: array are variable).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MAX_COUNT = 1 << 32  # far above any real tensor/key count; guards against garbage headers

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What validate_gguf learned from the header (metadata values are not decoded)."""

    version: int
    num_tensors: int
    num_metadata: int
    data_offset: int
    tensor_types: frozenset[str]


class _Reader:
    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise CorruptModelFile(f"{self.path}: GGUF header is truncated or corrupt (at byte {self.pos})")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR_FORMATS:
            self.take(struct.calcsize(_SCALAR_FORMATS[vtype]))
        elif vtype == 8:
            self.take(self.unpack("<Q"))
        elif vtype == 9:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR_FORMATS:
                self.take(count * struct.calcsize(_SCALAR_FORMATS[item_type]))
            elif item_type in (8, 9) and count <= len(self.buf):
                for _ in range(count):
                    self.skip_value(item_type)
            else:
                raise CorruptModelFile(f"{self.path}: bad GGUF metadata array (type {item_type}, count {count})")
        else:
            raise CorruptModelFile(f"{self.path}: unknown GGUF metadata value type {vtype}")


def validate_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """Check magic, version, metadata and that every tensor lies inside the file. CorruptModelFile if not."""
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise CorruptModelFile(f"{path}: too small to be a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _Reader(buf, path)
        if bytes(buf[:4]) != b"GGUF":
            raise CorruptModelFile(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        r.take(4)
        version = r.unpack("<I")
        if version not in (2, 3):
            raise CorruptModelFile(f"{path}: unsupported GGUF version {version} (need 2 or 3)")
        num_tensors, num_kv = r.unpack("<Q"), r.unpack("<Q")
        if num_tensors > _MAX_COUNT or num_kv > _MAX_COUNT:
            raise CorruptModelFile(f"{path}: corrupt GGUF header ({num_tensors} tensors, {num_kv} keys)")
        alignment = 32
        for _ in range(num_kv):
            key, vtype = r.string(), r.unpack("<I")
            if key == "general.alignment" and vtype == 4:
                alignment = r.unpack("<I")
            else:
                r.skip_value(vtype)
        if alignment <= 0 or alignment & (alignment - 1):
            raise CorruptModelFile(f"{path}: bad GGUF alignment {alignment}")
        extents: list[tuple[str, int, int]] = []
        types: set[str] = set()
        for _ in range(num_tensors):
            name, ndim = r.string(), r.unpack("<I")
            if ndim > 8:
                raise CorruptModelFile(f"{path}: tensor {name!r} has {ndim} dimensions")
            dims = [r.unpack("<Q") for _ in range(ndim)]
            ttype, offset = r.unpack("<I"), r.unpack("<Q")
            if ttype not in GGML_TYPES:
                raise CorruptModelFile(f"{path}: tensor {name!r} has unsupported ggml type {ttype}")
            tname, block, block_bytes = GGML_TYPES[ttype]
            numel = 1
            for d in dims:
                numel *= d
            if numel % block:
                raise CorruptModelFile(f"{path}: tensor {name!r} size {numel} is not a multiple of {block}")
            types.add(tname)
            extents.append((name, offset, numel // block * block_bytes))
        data_offset = -(-r.pos // alignment) * alignment
        for name, offset, nbytes in extents:
            if data_offset + offset + nbytes > size:
                raise CorruptModelFile(
                    f"{path}: truncated GGUF file: tensor {name!r} ends at byte {data_offset + offset + nbytes}, "
                    f"the file has {size}"
                )
    return GGUFHeader(version, num_tensors, num_kv, data_offset, frozenset(types))


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Validated tensors and metadata (scalars as Python values, token types as a list)."""
    validate_gguf(path)
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mlx raises plain RuntimeError/ValueError for unreadable files
        raise CorruptModelFile(f"{path}: cannot read GGUF file: {exc}") from exc
    weights, raw = cast("tuple[dict[str, mx.array], dict[str, Any]]", loaded)
    return weights, {k: _pyvalue(v) for k, v in raw.items()}


def _pyvalue(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


# --- config -------------------------------------------------------------------------------------------


def gguf_model_config(meta: dict[str, Any], weights: dict[str, mx.array], path: str = "") -> dict[str, Any]:
    """An mlx-lm llama config dict built from the `<arch>.*` metadata."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CorruptModelFile(f"{path}: unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHITECTURES})")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer values: llama needs them uniform
            if len(set(value)) != 1:
                raise CorruptModelFile(f"{path}: per-layer {key} {value[:4]}... is not supported")
            value = value[0]
        if value is None:
            raise CorruptModelFile(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else weights["token_embd.weight"].shape[0])
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(vocab),
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
        "tie_word_embeddings": "output.weight" not in weights,
        # GGUF stores Q/K rows permuted for interleaved (GPT-J style) RoPE.
        "rope_traditional": True,
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling == "linear" and factor != 1.0:
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling == "yarn":
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(meta.get(f"{arch}.rope.scaling.original_context_length", 4096)),
        }
    elif scaling not in ("none", "linear"):
        raise CorruptModelFile(f"{path}: unsupported RoPE scaling {scaling!r}")
    return config


# --- weights ------------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)$")


def gguf_to_mlx_names(weights: dict[str, mx.array], path: str = "") -> tuple[dict[str, mx.array], mx.array | None]:
    """Rename GGUF tensors to mlx-lm llama names. Returns (weights, rope_freqs factors or None)."""
    out: dict[str, mx.array] = {}
    rope_freqs = None
    for name, value in weights.items():
        if name == "rope_freqs.weight":  # llama-3 style per-dimension RoPE frequency factors
            rope_freqs = value
            continue
        m = _NAME.match(name)
        table = _LAYER_NAMES if m and m.group(1) is not None else _TOP_NAMES
        if m is None or m.group(2) not in table:
            raise CorruptModelFile(f"{path}: unexpected tensor {name!r} for a llama GGUF")
        layer, base, suffix = m.groups()
        prefix = f"model.layers.{layer}.{table[base]}" if layer is not None else table[base]
        out[f"{prefix}.{suffix}"] = value
    return out, rope_freqs


class FreqFactorRoPE(nn.Module):
    """RoPE with per-dimension frequency factors (GGUF `rope_freqs`): theta_i = base^(-2i/d) / factor_i."""

    def __init__(self, dims: int, base: float, factors: mx.array, traditional: bool) -> None:
        super().__init__()
        self.dims, self.traditional = dims, traditional
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def _quant_params(module: nn.Module, weight: mx.array, scales: mx.array) -> tuple[int, int]:
    in_dims = module.weight.shape[-1]  # the unquantized module's shape
    return in_dims // scales.shape[-1], weight.shape[-1] * 32 // in_dims


def checkpoint_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The float dtype to compute a GGUF checkpoint in, when kept as stored (the GPU default).

    Quantized files compute in float32, as llama.cpp does: GGUF's fp16 scales are a storage format, and
    fp16 activations are not safe (SmolLM2's residual stream reaches ~25k, where fp16's step is 16, and an
    fp16 forward flipped a near-tie top-1 token). Float files compute in their matrices' majority dtype.
    """
    counts: dict[mx.Dtype, int] = {}
    for key, value in weights.items():
        if key.endswith(".scales"):
            return mx.float32
        if value.ndim == 2 and mx.issubdtype(value.dtype, mx.floating):
            counts[value.dtype] = counts.get(value.dtype, 0) + value.size
    return max(counts, key=lambda d: counts[d]) if counts else mx.float32


def prepare_weights(
    model: nn.Module, weights: dict[str, mx.array], *, keep_quantized: bool, dtype: mx.Dtype
) -> dict[str, mx.array]:
    """Dequantize (to `dtype`) or quantize the model's layers to match, and cast floats to `dtype`."""
    modules = dict(model.named_modules())
    prefixes = [k[: -len(".scales")] for k in weights if k.endswith(".scales")]
    if keep_quantized:
        quantized = set(prefixes)

        def predicate(p: str, m: nn.Module) -> bool | dict[str, int]:
            if p not in quantized:
                return False
            group_size, bits = _quant_params(m, weights[f"{p}.weight"], weights[f"{p}.scales"])
            return {"group_size": group_size, "bits": bits}

        nn.quantize(model, class_predicate=predicate)
    else:
        for p in prefixes:
            w, scales, biases = weights.pop(f"{p}.weight"), weights.pop(f"{p}.scales"), weights.pop(f"{p}.biases")
            group_size, bits = _quant_params(modules[p], w, scales)
            # Dequantize in the target precision, not in the fp16 of the scales.
            weights[f"{p}.weight"] = mx.dequantize(w, scales.astype(dtype), biases.astype(dtype), group_size, bits)
    return {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }


# --- the model ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFModel:
    """What load_gguf returns; loader.py turns it into a LoadedModel."""

    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]
    metadata: dict[str, Any]
    dtype: mx.Dtype


def load_gguf(
    path: str | os.PathLike[str],
    *,
    keep_quantized: bool = False,
    dtype: mx.Dtype | None = mx.float32,
    on_progress: Callable[[str, float], None] | None = None,
) -> GGUFModel:
    """Build mlx-lm's llama model from a GGUF file. Weights are dequantized to `dtype` unless keep_quantized;
    dtype None takes the checkpoint's own float dtype."""
    report = on_progress or (lambda stage, fraction: None)
    path = str(path)
    report("reading", 0.05)
    weights, meta = read_gguf(path)
    try:
        return _build(path, weights, meta, keep_quantized=keep_quantized, dtype=dtype, report=report)
    except CorruptModelFile:
        raise
    except Exception as exc:  # any failure to interpret the file's contents means the file is bad
        raise CorruptModelFile(f"{path}: invalid llama GGUF contents: {type(exc).__name__}: {exc}") from exc


def _build(
    path: str,
    weights: dict[str, mx.array],
    meta: dict[str, Any],
    *,
    keep_quantized: bool,
    dtype: mx.Dtype | None,
    report: Callable[[str, float], None],
) -> GGUFModel:
    from mlx_lm.models import llama

    config = gguf_model_config(meta, weights, path)
    weights, rope_freqs = gguf_to_mlx_names(weights, path)
    report("tokenizer", 0.15)
    tokenizer = build_gguf_tokenizer(meta, path)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if rope_freqs is not None:
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.rope = FreqFactorRoPE(attn.head_dim, config["rope_theta"], rope_freqs, traditional=True)
    dtype = dtype or checkpoint_dtype(weights)
    weights = prepare_weights(model, weights, keep_quantized=keep_quantized, dtype=dtype)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise CorruptModelFile(f"{path}: GGUF tensors do not match a llama model: {exc}") from exc
    return GGUFModel(model, tokenizer, config, meta, dtype)
