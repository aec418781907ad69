"""The recurrent mixers' depthwise causal convolution (trillm.kernels.conv1d): the kernel against MLX's own
`nn.Conv1d` (an independent truth) and the reference for every dtype, with and without a bias, decode windows
and prefill lengths; calls it does not take go to the reference; the self-check checks and picks it only for
models that have such a conv; the engine's seam: `install_fused_ops` swaps a model's depthwise `nn.Conv1d`
(not a full one) and inside fused_ops() it runs the selection's `depthwise_conv1d`."""

from __future__ import annotations

import dataclasses
import re
import shutil

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn

from trillm.kernels import selfcheck
from trillm.kernels.conv1d import (
    OP, TOLERANCES, depthwise_conv1d_kernel, depthwise_conv1d_ref, depthwise_conv1d_taps,
)  # fmt: skip
from trillm.kernels.layout import ModelShapes

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _close(got: mx.array, want: mx.array, tol: tuple[float, float]) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               atol=tol[0], rtol=tol[1])


def _conv(C: int, K: int, bias: bool, dtype: mx.Dtype, seed: int) -> nn.Conv1d:
    mx.random.seed(seed)
    conv = nn.Conv1d(C, C, K, groups=C, bias=bias)
    if bias:
        conv.bias = mx.random.normal((C,))
    conv.update(nn.utils.tree_map(lambda p: p.astype(dtype), conv.parameters()))
    return conv


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("B,L,C,K,bias", [(1, 1, 64, 4, True), (16, 1, 96, 4, False), (3, 37, 40, 4, True),
                                          (2, 5, 33, 2, True), (1, 9, 8, 1, False)])  # fmt: skip
def test_kernel_matches_nn_conv1d(dtype: mx.Dtype, B: int, L: int, C: int, K: int, bias: bool) -> None:
    conv = _conv(C, K, bias, dtype, seed=L + C)
    x = mx.random.normal((B, L + K - 1, C), key=mx.random.key(C)).astype(dtype)
    want = conv(x)
    b = conv.bias if bias else None
    _close(depthwise_conv1d_taps(x, conv.weight, b), want, TOLERANCES[dtype])
    _close(depthwise_conv1d_ref(x, conv.weight, b), want, (0.0, 0.0))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: the CPU kernel emulator needs it")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("B,L,C,K,bias", [(2, 1, 300, 4, True), (1, 6, 40, 4, False), (2, 3, 33, 2, True)])
def test_gpu_body_under_the_emulator(dtype: mx.Dtype, B: int, L: int, C: int, K: int, bias: bool) -> None:
    # The shared Metal/CUDA body, its template and grid as on a GPU, run by the g++ thread emulator: channels
    # past one threadgroup (300 > 256) and fewer than one, a decode window and prefill lengths.
    import kernel_emulator

    kernel_emulator.install()
    conv = _conv(C, K, bias, dtype, seed=L * C)
    x = mx.random.normal((B, L + K - 1, C), key=mx.random.key(L)).astype(dtype)
    got = depthwise_conv1d_kernel(kernel_emulator.BACKEND, x, conv.weight, conv.bias if bias else None)
    _close(got, conv(x), TOLERANCES[dtype])


def test_calls_it_does_not_take_run_the_reference() -> None:
    x = mx.random.normal((2, 6, 8))
    w = mx.random.normal((8, 4, 1))
    # dtypes that differ, and an input shorter than the window: what MLX's conv does with them
    for args in ((x, w.astype(mx.float16), None), (x[:, :2], w, None)):
        try:
            want = depthwise_conv1d_ref(*args)
        except ValueError as exc:
            with pytest.raises(ValueError, match=re.escape(str(exc))):
                depthwise_conv1d_taps(*args)
        else:
            assert mx.array_equal(depthwise_conv1d_taps(*args), want).item()


def test_selfcheck_checks_and_picks_it_only_with_a_conv() -> None:
    # Wide enough that MLX's conv loses by far more than a loaded machine's noise (it is ~10x slower here).
    shapes = ModelShapes(8, 8, 64, 16, mx.float32, conv=(4096, 4), max_batch=16, chunk=64)
    sel = selfcheck.select_kernels(shapes, ops=[OP])
    (report,) = sel.report.ops
    assert report.implementation == "cpu" and not report.failed, report
    assert sel.depthwise_conv1d is depthwise_conv1d_taps
    plain = selfcheck.select_kernels(dataclasses.replace(shapes, conv=()), ops=[OP])
    assert plain.report.ops[0].implementation == "reference" and plain.depthwise_conv1d is depthwise_conv1d_ref


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(12, 12, 4, groups=12, bias=True)  # a mixer's short conv
        self.full = nn.Conv1d(12, 12, 4)  # not depthwise: MLX's own


def test_engine_seam_runs_the_selection_inside_fused_ops() -> None:
    from trillm.engine.fused_ops import FusedConv1d, depthwise_conv_shape, fused_ops, install_fused_ops

    model = _Mixer()
    x = mx.random.normal((3, 7, 12))
    want, want_full = model.conv1d(x), model.full(x)
    install_fused_ops(model)
    assert type(model.conv1d) is FusedConv1d and type(model.full) is nn.Conv1d
    assert depthwise_conv_shape(model) == (12, 4)
    calls: list[int] = []

    def counting(*args: mx.array | None) -> mx.array:
        calls.append(1)
        return depthwise_conv1d_taps(*args)  # type: ignore[arg-type]

    assert mx.array_equal(model.conv1d(x), want).item() and not calls  # outside fused_ops: MLX's own
    with fused_ops(dataclasses.replace(selfcheck.unchecked(), depthwise_conv1d=counting)):
        got, got_full = model.conv1d(x), model.full(x)
    assert len(calls) == 1
    _close(got, want, TOLERANCES[mx.float32])
    assert mx.array_equal(got_full, want_full).item()
