"""The gated delta rule (trillm.kernels.gated_delta): the reference against mlx-lm's own `gated_delta_ops`
(an independent truth), the CPU primitive against both; decode (T = 1) and prefill scans, GQA ratios above 1,
a scalar and a per-channel gate, ragged rows (a mask), every input dtype; the self-check's view of it; and the
engine's seam: a model's gated_delta_update runs the primitive inside fused_ops() and mlx-lm's own outside."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from mlx_lm.models import gated_delta as mlx_gdn

from trillm.kernels import cpu_ext, selfcheck
from trillm.kernels.gated_delta import OP, TOLERANCES, gated_delta_cpu, gated_delta_ref
from trillm.kernels.layout import ModelShapes

pytestmark = pytest.mark.skipif(
    os.environ.get(cpu_ext.DISABLE_ENV, "").lower() in ("0", "off", "false", "no"),
    reason=f"{cpu_ext.DISABLE_ENV} turns the CPU extension off",
)


def _inputs(B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, dtype: mx.Dtype, vector_gate: bool,
            ragged: bool, seed: int = 0) -> tuple[mx.array, ...]:
    ks = mx.random.split(mx.random.key(seed), 6)
    q = (mx.random.normal((B, T, Hk, Dk), key=ks[0]) * Dk**-0.5).astype(dtype)
    k = (mx.random.normal((B, T, Hk, Dk), key=ks[1]) * Dk**-0.5).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype)
    g = mx.exp(-mx.abs(mx.random.normal((B, T, Hv, Dk) if vector_gate else (B, T, Hv), key=ks[3])))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=ks[4])).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk), key=ks[5])
    if not ragged:
        return q, k, v, g, beta, state
    # Row i has T - i % 3 real tokens (right padding), row 0 none padded.
    mask = mx.arange(T)[None, :] < mx.array([T - i % 3 for i in range(B)])[:, None]
    return q, k, v, g, beta, state, mask


def _close(got: mx.array, want: mx.array, tol: tuple[float, float]) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               atol=tol[0], rtol=tol[1])


SHAPES = [  # B, T, Hk, Hv, Dk, Dv
    (1, 1, 2, 4, 128, 128),  # decode, GQA 2
    (9, 1, 1, 3, 64, 32),  # decode, GQA 3, vector lanes of any ISA
    (3, 19, 2, 2, 128, 64),  # prefill, no GQA
    (2, 7, 2, 6, 24, 8),  # Dk not a multiple of any ISA's lanes: the scalar rows
]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("vector_gate", [False, True], ids=["scalar-g", "vector-g"])
@pytest.mark.parametrize("ragged", [False, True], ids=["even", "ragged"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}Hk{}Hv{}Dk{}Dv{}".format(*s))
def test_cpu_matches_mlx_lm_and_reference(shape: tuple[int, ...], dtype: mx.Dtype, vector_gate: bool,
                                          ragged: bool) -> None:
    args = _inputs(*shape, dtype, vector_gate, ragged)
    want_y, want_state = mlx_gdn.gated_delta_ops(*args)
    ref_y, ref_state = gated_delta_ref(*args)
    _close(ref_y, want_y, (0.0, 0.0))  # the same ops in the same order
    _close(ref_state, want_state, (0.0, 0.0))
    y, state = gated_delta_cpu(*args)
    _close(y, want_y, TOLERANCES[dtype])
    _close(state, want_state, TOLERANCES[mx.float32])


def test_masked_tokens_leave_the_state_and_padding_matches_a_shorter_run() -> None:
    q, k, v, g, beta, state, mask = _inputs(3, 9, 2, 4, 128, 32, mx.float32, False, True, seed=3)
    _, new = gated_delta_cpu(q, k, v, g, beta, state, mask)
    for row in range(3):
        n = 9 - row % 3  # its real tokens
        y1, alone = gated_delta_cpu(q[row:row + 1, :n], k[row:row + 1, :n], v[row:row + 1, :n], g[row:row + 1, :n],
                                    beta[row:row + 1, :n], state[row:row + 1])
        _close(new[row:row + 1], alone, TOLERANCES[mx.float32])
    all_masked = mx.zeros_like(mask)
    _, kept = gated_delta_cpu(q, k, v, g, beta, state, all_masked)
    assert mx.array_equal(kept, state).item()


def test_long_scan_stays_close() -> None:
    # A 256-token scan at Qwen3.5's head shapes: errors must not compound across tokens.
    args = _inputs(1, 256, 2, 4, 128, 128, mx.bfloat16, False, False, seed=5)
    want_y, want_state = mlx_gdn.gated_delta_ops(*args)
    y, state = gated_delta_cpu(*args)
    _close(y, want_y, TOLERANCES[mx.bfloat16])
    _close(state, want_state, (1e-3, 1e-3))


def test_selfcheck_checks_and_routes_it() -> None:
    shapes = ModelShapes(4, 2, 64, 16, mx.float32, max_batch=4, chunk=16, delta_net=(2, 4, 128, 64))
    assert OP.applies(shapes) and not OP.applies(ModelShapes(4, 2, 64, 16, mx.float32))
    assert selfcheck.check_kernel(OP, OP.kernels["cpu"], shapes) is None
    sel = selfcheck.select_kernels(shapes, ops=[OP], timing_iters=1)
    report = next(r for r in sel.report.ops if r.op == "gated_delta")
    assert (sel.gated_delta is None) == (report.implementation == "reference"), report
    # A planted wrong kernel mismatches and is set aside: the model's own gated_delta_update runs.
    bad = OP.kernels["cpu"].__class__(lambda *a: (gated_delta_ref(*a)[0] * 1.5, gated_delta_ref(*a)[1]))
    failure = selfcheck.check_kernel(OP, bad, shapes)
    assert failure is not None and "output 0" in failure
    # A model without delta-net layers: nothing checked, mlx-lm's own runs.
    assert selfcheck.select_kernels(ModelShapes(4, 2, 64, 16, mx.float32), ops=[OP]).gated_delta is None


def test_engine_seam_routes_the_models_own_call() -> None:
    from mlx_lm.models import qwen3_5

    from trillm.engine.fused_ops import _fused_gated_delta, fused_ops

    calls: list[int] = []

    def counting(*args: object) -> tuple[mx.array, mx.array]:
        calls.append(1)
        return gated_delta_cpu(*args)  # type: ignore[arg-type]

    original = mlx_gdn.gated_delta_update
    fused = _fused_gated_delta(original)
    ks = mx.random.split(mx.random.key(7), 5)
    q = mx.random.normal((2, 5, 2, 64), key=ks[0]) * 0.1
    k = mx.random.normal((2, 5, 2, 64), key=ks[1]) * 0.1
    v = mx.random.normal((2, 5, 4, 32), key=ks[2])
    a, b = mx.random.normal((2, 5, 4), key=ks[3]), mx.random.normal((2, 5, 4), key=ks[4])
    A_log, dt_bias = mx.log(mx.arange(1, 5).astype(mx.float32)), mx.ones(4)
    mask = mx.arange(5)[None, :] < mx.array([5, 3])[:, None]
    want = original(q, k, v, a, b, A_log, dt_bias, None, mask)
    assert not calls and mx.allclose(fused(q, k, v, a, b, A_log, dt_bias, None, mask)[0], want[0]).item()
    sel = selfcheck.unchecked()
    import dataclasses

    with fused_ops(dataclasses.replace(sel, gated_delta=counting)):
        got = fused(q, k, v, a, b, A_log, dt_bias, None, mask, use_kernel=True)
        kept = fused(q, k, v, a, b, A_log, dt_bias, None, mask, use_kernel=False)  # mlx-lm's training path
    assert len(calls) == 1
    for g, w in zip(got, want):
        _close(g, w, TOLERANCES[mx.float32])
    assert mx.array_equal(kept[1], want[1]).item()
    assert hasattr(qwen3_5, "gated_delta_update")
    assert sys.modules[original.__module__] is mlx_gdn


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: the CPU kernel emulator needs it")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("shape, vector_gate, ragged", [
    ((2, 1, 1, 2, 64, 8), False, False),  # decode, GQA 2
    ((2, 6, 2, 6, 32, 4), True, True),  # a ragged scan, GQA 3, a per-channel gate
], ids=["decode", "ragged-scan"])  # fmt: skip
def test_gpu_body_under_the_emulator(shape: tuple[int, ...], vector_gate: bool, ragged: bool, dtype: mx.Dtype) -> None:
    # The shared Metal/CUDA body, its template and grid as on a GPU, run by the g++ thread emulator.
    import kernel_emulator

    from trillm.kernels.gated_delta import gated_delta_kernel

    kernel_emulator.install()
    args = _inputs(*shape, dtype, vector_gate, ragged, seed=11)
    y, state = gated_delta_kernel(kernel_emulator.BACKEND, *args)
    want_y, want_state = mlx_gdn.gated_delta_ops(*args)
    _close(y, want_y, TOLERANCES[dtype])
    _close(state, want_state, TOLERANCES[mx.float32])
