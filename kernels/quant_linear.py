"""y = x @ dequantize(w).T on weights kept quantized in MLX's affine layout: the reference (dequantize, then
BLAS), the CPU primitive and the dispatcher.

The layout is mx.quantize's: `bits`-bit unsigned q packed little-endian into uint32 words along K, a scale
and a bias per group of `group_size` along K, w = scale * q + bias. GGUF's Q4_0, Q4_1, Q8_0 and Q4_K blocks
are repacked into it exactly (engine/gguf.py), and MLX's quantized folders are stored in it.

On CPU, MLX's own quantized matmul reads the weights slower than the fp32 BLAS path does (platform notes;
measured here: ~25-50 ms at one row on a 49152 x 576 4-bit weight, about the fp32 matvec's time, and
4-20x slower than fp32 at 8-32 rows), and `mx.dequantize` runs at ~65M elements/s. The CPU primitive
(kernels/cpu/quant_linear.cpp), on x86 (AVX2, AVX-512), takes every row count as llama.cpp does: x rounded
per block of 32 (`quantize_x_ref`; to int16 by default, int8 as llama.cpp) and integer dot products, one
arithmetic whatever the row count, so a row's output does not depend on what it is batched with. NEON and
generic builds take the same arithmetic (by construction x86's int16 one) for calls of up to `MAX_ROWS` rows (NEON's widening
multiply-accumulate for int16 x, Armv8.2's sdot for int8), and past them dequantize blocks of weight rows to
fp32 and call cblas_sgemm; with `x_bits=32`, every ISA unpacks the weights to fp32 in registers up to `MAX_ROWS`
rows, and takes the sgemm path past them. It handles 4- and 8-bit weights with group sizes of 32, 64 or 128; other widths (5-, 6-bit) run mx.quantized_matmul.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import Case, Kernel, KernelOp, random_array
from trillm.kernels.layout import ModelShapes

XBITS_ENV = "TRILLM_QUANT_LINEAR_XBITS"  # x rounded to 16 (default) or 8 bits on x86; 32: the fp32 paths
X_BITS = (8, 16, 32)
MAX_ROWS = 32  # rows the register kernel takes; more rows go to the primitive's dequantize + sgemm path
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # what mx.dequantize (the reference) takes; the primitive needs multiples of 16
SCALE_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def quant_linear_ref(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                     bits: int) -> mx.array:
    """x [..., K] float32; w uint32 [N, K * bits / 32]; scales, biases [N, K / group_size] -> [..., N]
    float32: the weight dequantized in float32, then one matmul."""
    f32 = mx.float32
    dense = mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size=group_size, bits=bits)
    return x @ dense.T


def quantized_matmul_mlx(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                         bits: int) -> mx.array:
    """MLX's own quantized matmul (what nn.QuantizedLinear runs): the GPU path, and the CPU's for formats
    the primitive does not take."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


@cache
def default_x_bits() -> int:
    """$TRILLM_QUANT_LINEAR_XBITS: 16 (the default), 8 (llama.cpp's int8 activations) or 32 (the fp32 path)."""
    raw = os.environ.get(XBITS_ENV, "").strip() or "16"
    if not raw.isdigit() or int(raw) not in X_BITS:
        raise ValueError(f"{XBITS_ENV}={raw!r}: one of {', '.join(map(str, X_BITS))}")
    return int(raw)


def quant_linear_cpu(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                     bits: int, *, x_bits: int | None = None) -> mx.array:
    """The primitive of trillm's CPU extension. Shapes as the reference. `x_bits` (default
    $TRILLM_QUANT_LINEAR_XBITS, else 16): rows rounded to int16 or int8 per block of 32 (`quantize_x_ref`),
    integer dot products (where `rounded_x_bits` says); 32: the fp32 paths, exact to float rounding."""
    ext = cpu_ext.load()
    if ext is None:
        raise RuntimeError(f"trillm's CPU extension is unavailable: {cpu_ext.status().reason}")
    out: mx.array = ext.quant_linear(x, w, scales, biases, group_size=group_size, bits=bits, max_rows=MAX_ROWS,
                                     x_bits=default_x_bits() if x_bits is None else x_bits)
    return out


def rounded_x_bits(rows: int = 1) -> int | None:
    """The bits the primitive rounds x to by default in a call of `rows` rows (every row count on x86 with
    AVX2 or AVX-512; up to MAX_ROWS on NEON and generic builds), or None where the call runs an fp32 path."""
    bits = default_x_bits()
    isa = cpu_ext.isa()
    if bits == 32 or isa == "ref" or (isa not in ("avx2", "avx512") and rows > MAX_ROWS):
        return None
    return bits


def quantize_x_ref(x: mx.array, x_bits: int) -> mx.array:
    """x [..., K] as the integer decode path sees it: per block of 32 along K, round(x / d) * d with
    d = max|x| / (2^(x_bits - 1) - 1) (x_bits 8: llama.cpp's Q8_0 activations)."""
    top = float(2 ** (x_bits - 1) - 1)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
    inv = mx.where(amax > 0, top / mx.where(amax > 0, amax, 1.0), 0.0)
    return (mx.round(blocks * inv) * (amax / top)).reshape(x.shape)


def quant_linear_xq_ref(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                        bits: int, x_bits: int) -> mx.array:
    """What the integer decode path computes, in float32: x rounded per block (`quantize_x_ref`), then the
    reference."""
    return quant_linear_ref(quantize_x_ref(x, x_bits), w, scales, biases, group_size, bits)


def cpu_supports(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> bool:
    k = x.shape[-1] if x.ndim else 0
    return (
        x.dtype == mx.float32 and bits in BITS and group_size in GROUP_SIZES and w.dtype == mx.uint32
        and w.ndim == 2 and k > 0 and k % group_size == 0 and w.shape[1] * 32 == k * bits
        and scales.dtype in SCALE_DTYPES.values() and biases.dtype == scales.dtype
        and scales.shape == biases.shape == (w.shape[0], k // group_size)
    )  # fmt: skip


def quant_linear_cpu_kernel(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                            bits: int) -> mx.array:
    """The "cpu" kernel the self-check runs: the primitive where it takes the format, else MLX's."""
    if cpu_supports(x, w, scales, biases, group_size, bits):
        return quant_linear_cpu(x, w, scales, biases, group_size, bits)
    return quantized_matmul_mlx(x, w, scales, biases, group_size, bits)


def quant_linear(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int) -> mx.array:
    """x @ dequantize(w).T: the CPU primitive on CPU where it takes the format, else MLX's quantized matmul.
    Unchecked: the engine runs what its start-up self-check chose (`trillm.kernels.selfcheck`)."""
    if cpu_ext.enabled() and cpu_supports(x, w, scales, biases, group_size, bits) and cpu_ext.load() is not None:
        return quant_linear_cpu(x, w, scales, biases, group_size, bits)
    return quantized_matmul_mlx(x, w, scales, biases, group_size, bits)


# Decode rows on x86 round x per block of 32: at int16 (the default) within 1e-4 like the fp32 paths; at
# int8 (TRILLM_QUANT_LINEAR_XBITS=8) ~0.5% of |y| rms on the check cases' N(0, 1) rows (normalized mean
# squared error ~3e-5, under llama.cpp's 5e-4 for its quantized matmuls), the largest error seen 0.02.
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {mx.float32: (0.06, 0.02) if default_x_bits() == 8 else (2e-4, 2e-4)}


def _applies(shapes: ModelShapes) -> bool:
    return bool(shapes.quantization)


def _supported(shapes: ModelShapes) -> str | None:
    if cpu_ext.load() is None:
        return f"trillm's CPU extension is unavailable: {cpu_ext.status().reason}"
    if not any(bits in BITS and group in GROUP_SIZES for bits, group, _ in shapes.quantization):
        return f"no format the primitive takes among {shapes.quantization} (bits {BITS}, groups {GROUP_SIZES})"
    return None


def random_quantized(n: int, k: int, group_size: int, bits: int, scales_dtype: str, seed: int) -> tuple[mx.array, ...]:
    """(w, scales, biases) of a random [n, k] weight, scales and biases in `scales_dtype`."""
    w, s, b = mx.quantize(random_array((n, k), mx.float32, seed, scale=k**-0.5), group_size=group_size, bits=bits)
    dt = SCALE_DTYPES[scales_dtype]
    return w, s.astype(dt), b.astype(dt)


def _formats(shapes: ModelShapes) -> list[tuple[int, int, str]]:
    return [f for f in shapes.quantization if f[0] in BITS and f[1] in GROUP_SIZES]


def _check_cases(shapes: ModelShapes) -> list[Case]:
    h = shapes.hidden
    out = []
    for bits, group, sdt in _formats(shapes):
        if h % group:
            continue
        for n, k in ((3 * h + 5, h), (h, max(group, shapes.intermediate // group * group))):
            q = random_quantized(n, k, group, bits, sdt, 31 + n)
            for rows in sorted({1, 2, 3, 5, 9, 17, min(shapes.max_batch, MAX_ROWS), MAX_ROWS, MAX_ROWS + 1, 67}):
                x = random_array((rows, 1, k), mx.float32, 40 + rows)
                out.append(Case(f"q{bits} g{group} {sdt} {(n, k)} rows={rows}", (x, *q, group, bits)))
    return out


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    """Decode at batch 1 and at the most rows the register kernel takes, one prefill chunk, per format, on
    a weight of up to 4096 x hidden rows (the reference dequantizes it on every call)."""
    k = shapes.hidden
    n = max(64, min(shapes.vocab, 4096) // 16 * 16)
    out = []
    for bits, group, sdt in _formats(shapes):
        if k % group:
            continue
        q = random_quantized(n, k, group, bits, sdt, 90)
        for phase, rows in (("decode", 1), ("decode", min(shapes.max_batch, MAX_ROWS)), ("prefill", min(shapes.chunk, 256))):
            x = random_array((rows, 1, k), mx.float32, 95 + rows)
            out.append(Case(f"{phase} q{bits} g{group} {sdt} rows={rows} {(n, k)}", (x, *q, group, bits)))
    return out


def _phase(x: mx.array, *args: Any, **kwargs: Any) -> str:
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    return "decode" if rows <= MAX_ROWS else "prefill"


KERNELS: dict[str, Kernel] = {"cpu": Kernel(quant_linear_cpu_kernel, _supported)}

OP = KernelOp(
    name="quant_linear", reference=quant_linear_ref, kernels=KERNELS, check_cases=_check_cases,
    timing_cases=_timing_cases, tolerances=TOLERANCES, applies=_applies, phase_of=_phase,
    fallback=quantized_matmul_mlx,
)  # fmt: skip
