"""Load GGUF files (llama, mistral, mistral3/ministral3, qwen2, qwen3, gemma2, gemma3, phi3) into mlx-lm's
own model classes, with a tokenizer rebuilt from the metadata.

The file is read in pure Python and numpy, never trusting it: the header and every tensor's extent are
checked first (`validate_gguf`), so a truncated or corrupt file is a CorruptModelFile, not a crash.
Tensors take one of two paths:
- Q4_0, Q4_1, Q8_0, Q4_K and Q5_K are affine formats MLX holds natively (groups of 32): their blocks are
  repacked exactly into MLX weight/scales/biases triples (kept quantized on the GPU, dequantized exactly on
  the CPU);
- every other type (Q6_K, whose 16-element groups MLX cannot hold; Q5_0, Q2_K, Q3_K, IQ*, ...) is
  dequantized to float32 by the `gguf` package's numpy code, which is llama.cpp's own reference.
"""

from __future__ import annotations

import importlib
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from trillm.engine.errors import CorruptModelFile
from trillm.engine.gguf_arch import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from trillm.engine.gguf_arch import gguf_model_config, gguf_to_mlx_names, unpermute_qk
from trillm.engine.gguf_tokenizer import build_gguf_tokenizer
from trillm.engine.tokenizer import Tokenizer

# ggml tensor type -> (name, elements per block, bytes per block), from the gguf package (llama.cpp's).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES
}
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _Q4_K, _Q5_K, _BF16, _F64 = 0, 1, 2, 3, 8, 12, 13, 30, 28
_INTEGER_TYPES = {24, 25, 26, 27}  # I8..I64: no model weight uses them
# GGUF metadata value type -> struct format of one scalar (8: string, 9: array are variable).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MAX_COUNT = 1 << 32  # far above any real tensor/key count; guards against garbage headers

@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What validate_gguf learned from the header."""

    version: int
    num_tensors: int
    num_metadata: int
    data_offset: int
    tensor_types: frozenset[str]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's header entry. shape is numpy order (ggml's ne reversed: the last axis is contiguous)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


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

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                start = self.take(count * struct.calcsize(fmt))  # bounds-checked before unpacking
                return list(struct.unpack_from(f"<{count}{fmt[1:]}", self.buf, start))
            if item_type in (8, 9) and count <= len(self.buf):
                return [self.value(item_type) for _ in range(count)]
            raise CorruptModelFile(f"{self.path}: bad GGUF metadata array (type {item_type}, count {count})")
        raise CorruptModelFile(f"{self.path}: unknown GGUF metadata value type {vtype}")


def _parse(path: Path, *, decode: bool) -> tuple[GGUFHeader, dict[str, Any], list[TensorInfo]]:
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
        meta: dict[str, Any] = {}
        for _ in range(num_kv):
            key, vtype = r.string(), r.unpack("<I")
            value = r.value(vtype)
            if decode or key == "general.alignment":
                meta[key] = value
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise CorruptModelFile(f"{path}: bad GGUF alignment {alignment}")
        raw: list[tuple[str, list[int], int, int, int]] = []
        for _ in range(num_tensors):
            name, ndim = r.string(), r.unpack("<I")
            if ndim > 8:
                raise CorruptModelFile(f"{path}: tensor {name!r} has {ndim} dimensions")
            dims = [r.unpack("<Q") for _ in range(ndim)]
            ttype, offset = r.unpack("<I"), r.unpack("<Q")
            if ttype not in GGML_TYPES:
                raise CorruptModelFile(f"{path}: tensor {name!r} has unsupported ggml type {ttype}")
            _, block, block_bytes = GGML_TYPES[ttype]
            if dims and dims[0] % block:  # blocks never straddle rows
                raise CorruptModelFile(f"{path}: tensor {name!r} row of {dims[0]} is not a multiple of {block}")
            numel = 1
            for d in dims:
                numel *= d
            raw.append((name, dims, ttype, offset, numel // block * block_bytes))
        data_offset = -(-r.pos // alignment) * alignment
    infos: list[TensorInfo] = []
    for name, dims, ttype, offset, nbytes in raw:
        if data_offset + offset + nbytes > size:
            raise CorruptModelFile(
                f"{path}: truncated GGUF file: tensor {name!r} ends at byte {data_offset + offset + nbytes}, "
                f"the file has {size}"
            )
        infos.append(TensorInfo(name, tuple(reversed(dims)), ttype, data_offset + offset, nbytes))
    header = GGUFHeader(version, num_tensors, num_kv, data_offset, frozenset(GGML_TYPES[t.ggml_type][0] for t in infos))
    return header, meta, infos


def validate_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """Check magic, version, metadata and that every tensor lies inside the file. CorruptModelFile if not."""
    return _parse(Path(path), decode=False)[0]


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The validated file's metadata (scalars as Python values, arrays as lists); no tensor is read."""
    return _parse(Path(path), decode=True)[1]


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Validated tensors and metadata. Q4_0/Q4_1/Q8_0/Q4_K/Q5_K tensors arrive as MLX affine triples
    (`x.weight`, `x.scales`, `x.biases`), other quantized types dequantized to float32."""
    path = Path(path)
    _, meta, infos = _parse(path, decode=True)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    weights: dict[str, mx.array] = {}
    for info in infos:
        try:
            weights.update(read_tensor(data[info.offset : info.offset + info.nbytes], info))
        except CorruptModelFile:
            raise
        except Exception as exc:  # numpy reshape/view errors: the header's shape does not fit the bytes
            raise CorruptModelFile(f"{path}: cannot read tensor {info.name!r}: {exc}") from exc
    return weights, meta


def read_tensor(raw: np.ndarray, info: TensorInfo) -> dict[str, mx.array]:
    """One tensor from its raw bytes: {name: array}, or the MLX affine triple for Q4_0/Q4_1/Q8_0/Q4_K/Q5_K."""
    t, shape = info.ggml_type, info.shape
    if t == _F32:
        return {info.name: mx.array(raw.view(np.float32).reshape(shape))}
    if t == _F16:
        return {info.name: mx.array(raw.view(np.float16).reshape(shape))}
    if t == _BF16:
        return {info.name: mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16)}
    if t == _F64:
        return {info.name: mx.array(raw.view(np.float64).astype(np.float32).reshape(shape))}
    if t in _INTEGER_TYPES:
        raise CorruptModelFile(f"tensor {info.name!r} has integer type {GGML_TYPES[t][0]}, which no weight uses")
    if t in (_Q4_0, _Q4_1, _Q8_0) and len(shape) >= 1:
        return _affine_triple(raw, info)
    if t in (_Q4_K, _Q5_K) and len(shape) >= 1:
        return _kquant_triple(raw, info)
    qtype = GGMLQuantizationType(t)
    values = gguf_dequantize(raw.reshape(*shape[:-1], -1), qtype)
    return {info.name: mx.array(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))}


def _affine_triple(raw: np.ndarray, info: TensorInfo) -> dict[str, mx.array]:
    """Q4_0 (x = d*(q-8)), Q4_1 (x = d*q + m) and Q8_0 (x = d*q) blocks of 32 as MLX's affine quantization
    (x = scale*q + bias, group 32): the same numbers, with q packed little-endian into uint32 words."""
    t, shape = info.ggml_type, info.shape
    _, _, block_bytes = GGML_TYPES[t]
    blocks = raw.reshape(-1, block_bytes)
    d = np.ascontiguousarray(blocks[:, :2]).view(np.float16)
    if t == _Q8_0:
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # MLX's q is unsigned
        packed, scales, biases = q, d, d * np.float16(-128)
    else:
        qs = blocks[:, 2:] if t == _Q4_0 else blocks[:, 4:]
        # ggml: element j < 16 is the low nibble of byte j, element 16 + j its high nibble; MLX: byte k
        # holds elements 2k (low) and 2k + 1 (high).
        even, odd = qs[:, 0::2], qs[:, 1::2]
        packed = np.concatenate([(even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=1)
        scales = d
        biases = d * np.float16(-8) if t == _Q4_0 else np.ascontiguousarray(blocks[:, 2:4]).view(np.float16)
    rows = shape[:-1]
    base = info.name.removesuffix(".weight")
    return {
        info.name: mx.array(np.ascontiguousarray(packed).reshape(*rows, -1).view(np.uint32)),
        f"{base}.scales": mx.array(scales.reshape(*rows, -1)),
        f"{base}.biases": mx.array(biases.reshape(*rows, -1)),
    }


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing of `bits`-bit values along the last axis: a little-endian bit stream in uint32 words."""
    groups = q.reshape(-1, 8).astype(np.uint64) << (np.arange(8, dtype=np.uint64) * np.uint64(bits))
    stream = np.bitwise_or.reduce(groups, axis=1).view(np.uint8).reshape(-1, 8)[:, :bits]  # 8 values: `bits` bytes
    return np.ascontiguousarray(stream).reshape(*q.shape[:-1], -1).view(np.uint32)


def _kquant_triple(raw: np.ndarray, info: TensorInfo) -> dict[str, mx.array]:
    """Q4_K and Q5_K super-blocks of 256 as MLX affine 4- and 5-bit groups of 32, exactly: ggml's
    x = (d*sc)*q - dmin*m per sub-block of 32 is scale*q + bias with float32 scale = d*sc and bias = -(dmin*m)
    (both products exact in float32: an 11-bit half times a 6-bit integer)."""
    from gguf.quants import Q4_K

    t = info.ggml_type
    blocks = raw.reshape(-1, GGML_TYPES[t][2])
    nb = blocks.shape[0]
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16).astype(np.float32)
    dmin = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # the gguf package's (llama.cpp's) 6-bit unpacking
    # Sub-block 2j holds the low nibbles of qs[32j : 32j + 32], sub-block 2j + 1 their high nibbles; Q5_K
    # adds bit 2j (or 2j + 1) of qh[l] as the fifth bit of element l of that sub-block.
    qs = blocks[:, 16:] if t == _Q4_K else blocks[:, 48:]
    nibbles = qs.reshape(nb, 4, 1, 32)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)
    bits = 4
    if t == _Q5_K:
        qh = blocks[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4).reshape(nb, 4, 2, 32)
        bits = 5
    rows = info.shape[:-1]
    base = info.name.removesuffix(".weight")
    return {
        info.name: mx.array(_pack(q.reshape(*rows, -1), bits)),
        f"{base}.scales": mx.array((d * sc.astype(np.float32)).reshape(*rows, -1)),
        f"{base}.biases": mx.array((-(dmin * m.astype(np.float32))).reshape(*rows, -1)),
    }


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
    model: nn.Module, weights: dict[str, mx.array], *, keep_quantized: bool, dtype: mx.Dtype, keep_scales: bool = False
) -> dict[str, mx.array]:
    """Dequantize (to `dtype`) or quantize the model's layers to match, and cast floats to `dtype` (but the
    scales and biases of layers kept quantized, with keep_scales)."""
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
            # Dequantize in float32 (exact for every GGUF type mapped to a triple), then round once to dtype.
            f32 = mx.float32
            weights[f"{p}.weight"] = mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size, bits)
    # An embedding's lookup dequantizes in its scales' dtype: those are cast, so activations stay in dtype.
    kept = {f"{p}.{part}" for p in prefixes if not isinstance(modules.get(p), nn.Embedding)
            for part in ("scales", "biases")} if keep_quantized and keep_scales else set()  # fmt: skip
    return {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and k not in kept else v
        for k, v in weights.items()
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
    keep_scales: bool = False,
) -> GGUFModel:
    """Build the mlx-lm model of a GGUF file's architecture (see gguf_arch). Weights are dequantized to
    `dtype` unless keep_quantized; dtype None takes the checkpoint's own float dtype. keep_scales: layers
    kept quantized keep their scales' and biases' stored dtype (float16 for Q4_0/Q4_1/Q8_0)."""
    report = on_progress or (lambda stage, fraction: None)
    path = str(path)
    report("reading", 0.05)
    weights, meta = read_gguf(path)
    try:
        return _build(path, weights, meta, keep_quantized=keep_quantized, dtype=dtype, report=report,
                      keep_scales=keep_scales)
    except CorruptModelFile:
        raise
    except Exception as exc:  # any failure to interpret the file's contents means the file is bad
        raise CorruptModelFile(f"{path}: invalid GGUF contents: {type(exc).__name__}: {exc}") from exc


def _build(
    path: str,
    weights: dict[str, mx.array],
    meta: dict[str, Any],
    *,
    keep_quantized: bool,
    dtype: mx.Dtype | None,
    report: Callable[[str, float], None],
    keep_scales: bool = False,
) -> GGUFModel:
    config = gguf_model_config(meta, weights, path)
    arch = str(meta["general.architecture"])
    weights, rope_freqs = gguf_to_mlx_names(weights, path, arch)
    weights = unpermute_qk(weights, config)
    report("tokenizer", 0.15)
    tokenizer = build_gguf_tokenizer(meta, path)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if rope_freqs is not None:
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.rope = FreqFactorRoPE(attn.head_dim, config["rope_theta"], rope_freqs, traditional=True)
    if hasattr(model, "sanitize"):  # as mlx-lm's own load does: drops a tied head, marks Gemma 3 as tied
        weights = model.sanitize(weights)
    dtype = dtype or checkpoint_dtype(weights)
    weights = prepare_weights(model, weights, keep_quantized=keep_quantized, dtype=dtype, keep_scales=keep_scales)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise CorruptModelFile(f"{path}: GGUF tensors do not match a {arch} model: {exc}") from exc
    return GGUFModel(model, tokenizer, config, meta, dtype)
