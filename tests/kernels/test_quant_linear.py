"""The CPU quantized linear primitive against dequantize-then-matmul, and the self-check's decision for it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from trillm.kernels import cpu_ext
from trillm.kernels import quant_linear as ql
from trillm.kernels.backend import random_array
from trillm.kernels.layout import ModelShapes
from trillm.kernels.selfcheck import check_kernel, select_kernels

pytestmark = pytest.mark.skipif(cpu_ext.load() is None, reason="trillm's CPU extension is unavailable")


@pytest.mark.parametrize(("bits", "group", "scales"), [(4, 32, "float16"), (8, 32, "float16"), (4, 64, "bfloat16"),
                                                       (8, 128, "float32"), (4, 128, "float32")])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 32, 33, 80])
def test_primitive_equals_dequantize_then_matmul(bits: int, group: int, scales: str, rows: int) -> None:
    n, k = 53, 384  # n: no multiple of any tile; k: 3 groups of 128, a chunk boundary past 256
    w, s, b = ql.random_quantized(n, k, group, bits, scales, seed=bits + group)
    x = random_array((rows, 1, k), mx.float32, rows)
    got, want = ql.quant_linear_cpu(x, w, s, b, group, bits), _expected(x, w, s, b, group, bits)
    assert got.shape == want.shape == (rows, 1, n) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
    exact = ql.quant_linear_cpu(x, w, s, b, group, bits, x_bits=32)  # the fp32 path, on every ISA
    np.testing.assert_allclose(np.array(exact), np.array(ql.quant_linear_ref(x, w, s, b, group, bits)), atol=1e-4,
                               rtol=1e-4)
    if rows <= ql.MAX_ROWS and ql.rounded_x_bits() is not None:  # the int8 variant against its own rounding
        np.testing.assert_allclose(np.array(ql.quant_linear_cpu(x, w, s, b, group, bits, x_bits=8)),
                                   np.array(ql.quant_linear_xq_ref(x, w, s, b, group, bits, 8)), atol=1e-4, rtol=1e-4)


def _expected(x: mx.array, w: mx.array, s: mx.array, b: mx.array, group: int, bits: int) -> mx.array:
    """What the primitive computes: x's rows (any number) rounded per block where the ISA does that, else exact."""
    x_bits = ql.rounded_x_bits(x.size // x.shape[-1])
    if x_bits is None:
        return ql.quant_linear_ref(x, w, s, b, group, bits)
    return ql.quant_linear_xq_ref(x, w, s, b, group, bits, x_bits)


@pytest.mark.parametrize(("bits", "scales"), [(4, "float16"), (8, "float16"), (4, "float32")])
@pytest.mark.parametrize("x_bits", [8, 16])
def test_rounded_rows_stay_within_activation_rounding_of_the_exact_product(bits: int, scales: str,
                                                                          x_bits: int) -> None:
    """The integer decode path against dequantize-then-matmul: within llama.cpp's bound for quantized
    matmuls (normalized mean squared error 5e-4, test-backend-ops); int16 within the fp32 path's 1e-4."""
    n, k = 200, 1536
    w, s, b = ql.random_quantized(n, k, 32, bits, scales, seed=7)
    x = random_array((8, k), mx.float32, 8)
    got = np.array(ql.quant_linear_cpu(x, w, s, b, 32, bits, x_bits=x_bits))
    want = np.array(ql.quant_linear_ref(x, w, s, b, 32, bits))
    nmse = float(((got - want) ** 2).mean() / (want**2).mean())
    assert nmse < 5e-4
    if x_bits == 16:
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    if ql.rounded_x_bits() is not None and x_bits == 8:
        assert nmse > 1e-8  # the int8 path ran, not the fp32 one
        assert nmse > 1e3 * float(((np.array(ql.quant_linear_cpu(x, w, s, b, 32, bits, x_bits=16)) - want) ** 2).mean()
                                  / (want**2).mean())


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (4, 64)])
@pytest.mark.parametrize("x_bits", [8, 16, 32])
def test_a_rows_output_does_not_depend_on_the_other_rows(bits: int, group: int, x_bits: int) -> None:
    """Bit for bit: a row called alone equals the same row inside a call of 2-32 rows (a speculative verify's
    rows against plain decode's; a batch's rows against each row alone), tail weight rows included."""
    n, k = 1541, 576  # past one 8-row group per band, with a tail of 5
    w, s, b = ql.random_quantized(n, k, group, bits, "float16", seed=3)
    x = random_array((ql.MAX_ROWS, k), mx.float32, 11)
    alone = np.concatenate([np.array(ql.quant_linear_cpu(x[i:i + 1], w, s, b, group, bits, x_bits=x_bits))
                            for i in range(ql.MAX_ROWS)])
    for rows in (2, 5, 9, ql.MAX_ROWS):
        together = np.array(ql.quant_linear_cpu(x[:rows], w, s, b, group, bits, x_bits=x_bits))
        assert np.array_equal(together, alone[:rows]), rows
    if ql.rounded_x_bits(5 * ql.MAX_ROWS) is not None and x_bits != 32:  # prefill-sized calls: the same arithmetic
        many = mx.concatenate([x] * 5)  # 160 rows: past the kernel's row tiles of 64
        got = np.array(ql.quant_linear_cpu(many, w, s, b, group, bits, x_bits=x_bits))
        assert np.array_equal(got, np.concatenate([alone] * 5))


def test_quantized_x_reference_rounds_blocks_of_32() -> None:
    x = mx.array([[0.5 * (i % 7) - 1.0 for i in range(64)]]) * mx.array([[1.0] * 32 + [1e-3] * 32])
    q = np.array(ql.quantize_x_ref(x, 8))
    for block in (q[0, :32], q[0, 32:]):
        step = np.abs(block).max() / 127
        assert np.allclose(block / step, np.round(block / step), atol=1e-3)  # whole multiples of d per block
    np.testing.assert_allclose(q, np.array(x), rtol=0, atol=float(np.abs(np.array(x)).max()) / 254 + 1e-7)


def test_long_rows_cross_the_kernels_k_chunks() -> None:
    """K past the 1024-element chunk the multi-row path dequantizes at a time, and not a multiple of it."""
    w, s, b = ql.random_quantized(40, 2560, 64, 4, "float16", seed=3)
    for rows in (1, 9, 40):
        x = random_array((rows, 2560), mx.float32, rows)
        np.testing.assert_allclose(np.array(ql.quant_linear_cpu(x, w, s, b, 64, 4, x_bits=32)),
                                   np.array(ql.quant_linear_ref(x, w, s, b, 64, 4)), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.array(ql.quant_linear_cpu(x, w, s, b, 64, 4)),
                                   np.array(_expected(x, w, s, b, 64, 4)), atol=1e-4, rtol=1e-4)


def test_dispatcher_sends_other_formats_to_mlx() -> None:
    w, s, b = mx.quantize(random_array((32, 128), mx.float32, 1), group_size=32, bits=6)
    x = random_array((2, 128), mx.float32, 2)
    assert not ql.cpu_supports(x, w, s, b, 32, 6)
    assert mx.allclose(ql.quant_linear(x, w, s, b, 32, 6), ql.quant_linear_ref(x, w, s, b, 32, 6), atol=1e-4).item()


def test_bad_arguments_raise() -> None:
    w, s, b = ql.random_quantized(16, 64, 32, 4, "float16", seed=1)
    with pytest.raises(ValueError):
        ql.quant_linear_cpu(mx.zeros((1, 64), dtype=mx.float16), w, s, b, 32, 4)
    with pytest.raises(ValueError):
        ql.quant_linear_cpu(mx.zeros((1, 96)), w, s, b, 32, 4)
    with pytest.raises(ValueError):
        ql.quant_linear_cpu(mx.zeros((1, 64)), w, s, b, 32, 8)


def test_self_check_passes_and_applies_only_to_quantized_models(tmp_path: object,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRILLM_KERNEL_CACHE", str(tmp_path))
    shapes = ModelShapes(4, 2, 32, 16, mx.float32, max_batch=4, chunk=40, hidden_size=128, intermediate_size=256,
                         vocab_size=300, quantization=((4, 32, "float16"), (8, 64, "float32")))
    assert check_kernel(ql.OP, ql.KERNELS["cpu"], shapes) is None
    report = select_kernels(shapes, ops=[ql.OP], timing_iters=1).report
    assert report.ops[0].reason != "not used by this model" and not report.ops[0].failed
    plain = select_kernels(ModelShapes(4, 2, 32, 16, mx.float32), ops=[ql.OP]).report
    assert plain.ops[0].reason == "not used by this model"
