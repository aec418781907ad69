"""Mamba-2's state-space update (trillm.kernels.ssm_update): the CPU primitive against mlx-lm's own
`ssm_update` (an independent truth; off Metal its ops path, ssm_attn) for every input dtype, grouped heads
(H / G > 1, a head reading its group's B and C), head and state widths off any ISA's lanes, masked tokens and
rows that keep their state (negative lengths), at one token (decode) and over many (prefill: the scan against
SSD's chunked quadratic form, ragged right-padded and left-padded rows, no state, two chunks carrying the state
as one call); the self-check's view of it; the engine's seam: a model's ssm_update runs the primitive inside
fused_ops(); and the shared Metal/CUDA body (decode and prefill), registered for both back-ends, run by the g++
emulator against the reference and through the self-check (never on a GPU here)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from functools import partial
from types import ModuleType

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from mlx_lm.models import ssm as mlx_ssm

from trillm.kernels import cpu_ext, selfcheck
from trillm.kernels import ssm_update as ssm_op
from trillm.kernels.backend import Kernel
from trillm.kernels.layout import ModelShapes
from trillm.kernels.ssm_update import OP, TOLERANCES, ssm_update_cpu, ssm_update_ref

pytestmark = pytest.mark.skipif(
    os.environ.get(cpu_ext.DISABLE_ENV, "").lower() in ("0", "off", "false", "no"),
    reason=f"{cpu_ext.DISABLE_ENV} turns the CPU extension off",
)


def _inputs(B: int, H: int, G: int, Dh: int, Ds: int, dtype: mx.Dtype, seed: int = 0, L: int = 1) -> tuple[mx.array, ...]:
    ks = mx.random.split(mx.random.key(seed), 8)
    x = mx.random.normal((B, L, H, Dh), key=ks[0]).astype(dtype)
    # Over several tokens B and C at 1 / sqrt(Ds), as the self-check's cases: y of order one.
    bc = 1.0 if L == 1 else Ds**-0.5
    Bm = (mx.random.normal((B, L, G, Ds), key=ks[1]) * bc).astype(dtype)
    Cm = (mx.random.normal((B, L, G, Ds), key=ks[2]) * bc).astype(dtype)
    A_log = mx.log(mx.abs(mx.random.normal((H,), key=ks[3])) * 4 + 1).astype(dtype)
    D = mx.random.normal((H,), key=ks[4]).astype(dtype)
    dt = (mx.random.normal((B, L, H), key=ks[5]) * 2).astype(dtype)
    dt_bias = mx.random.normal((H,), key=ks[6]).astype(dtype)
    state = mx.random.normal((B, H, Dh, Ds), key=ks[7]) * 0.5
    return x, A_log, Bm, Cm, D, dt, dt_bias, state


def _close(got: mx.array, want: mx.array, tol: tuple[float, float]) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               atol=tol[0], rtol=tol[1])


def _mlx_lm(*args: object, **kw: object) -> tuple[mx.array, mx.array]:
    # mlx-lm's own entry point, as the model calls it (y includes D * x), on CPU: its ops path.
    with mx.stream(mx.cpu):
        y, state = mlx_ssm.ssm_update(*args, **kw)  # type: ignore[arg-type]
    return y, state


SHAPES = [  # B, H, G, Dh, Ds
    (1, 8, 1, 64, 128),  # Mamba-2's layout: one group for all heads
    (16, 8, 2, 32, 64),  # batch 16, 4 heads per group (Nemotron-H's grouped B, C)
    (3, 6, 3, 8, 20),  # Ds off every ISA's lanes (the scalar tail), Dh small
]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}G{}Dh{}Ds{}".format(*s))
def test_cpu_matches_mlx_lm(shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    args = _inputs(*shape, dtype, seed=sum(shape))
    want_y, want_state = _mlx_lm(*args)
    ref_y, ref_state = ssm_update_ref(*args)
    _close(ref_y, want_y, (0.0, 0.0))  # the same ops
    _close(ref_state, want_state, (0.0, 0.0))
    y, state = ssm_update_cpu(*args)
    _close(y, want_y, TOLERANCES[dtype])
    _close(state, want_state, TOLERANCES[mx.float32])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_masked_tokens_and_kept_states_match_mlx_lm(dtype: mx.Dtype) -> None:
    args = _inputs(6, 4, 2, 16, 32, dtype, seed=5)
    mask = mx.array([[True], [False], [True], [False], [True], [True]])
    # At one token a length is at most 1 (mlx-lm reads its decay at position length - 1).
    lengths = mx.array([1, 1, -1, -2, 0, 1])
    for m, ln in ((mask, None), (None, lengths), (mask, lengths)):
        want_y, want_state = _mlx_lm(*args, mask=m, lengths=ln)
        y, state = ssm_update_cpu(*args, mask=m, lengths=ln)
        _close(y, want_y, TOLERANCES[dtype])
        _close(state, want_state, TOLERANCES[mx.float32])
    # A masked row and a row with a negative length keep their state exactly.
    _, state = ssm_update_cpu(*args, mask=mask, lengths=lengths)
    for row in (1, 2, 3):
        assert mx.array_equal(state[row], args[-1][row]).item()
    assert not mx.array_equal(state[0], args[-1][0]).item()


def _right_padded(lengths: list[int], L: int) -> mx.array:
    return mx.arange(L)[None, :] < mx.array(lengths)[:, None]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_prefill_scan_matches_mlx_lm(dtype: mx.Dtype) -> None:
    # 300 tokens: across ssm_attn's 256-token chunks. Ragged right-padded rows as the engine builds them (one
    # whose padding starts in the second chunk, one whose prompt ended in an earlier call: negative length),
    # and a left-padded row (mlx-lm's own batching) without lengths. Every position compared, padding too.
    args = _inputs(4, 6, 3, 8, 20, dtype, seed=11, L=300)
    lengths = mx.array([300, 270, 40, -5])
    mask = _right_padded([300, 270, 40, 0], 300)
    left = mx.arange(300)[None, :] >= mx.array([0, 17, 255, 299])[:, None]
    for m, ln in ((None, None), (mask, lengths), (left, None)):
        want_y, want_state = _mlx_lm(*args, mask=m, lengths=ln)
        y, state = ssm_update_cpu(*args, mask=m, lengths=ln)
        _close(y, want_y, TOLERANCES[dtype])
        _close(state, want_state, TOLERANCES[mx.float32])
    # The row with a negative length keeps its state exactly; the row padded from token 40 returns the
    # state after token 39, the one a 40-token call returns.
    _, state = ssm_update_cpu(*args, mask=mask, lengths=lengths)
    assert mx.array_equal(state[3], args[-1][3]).item()
    cut = [a[2:3, :40] if a.ndim >= 3 and a.shape[1] == 300 else a for a in args[:-1]]
    _, short = ssm_update_cpu(*cut, args[-1][2:3])
    _close(state[2:3], short, (1e-6, 1e-6))


def test_prefill_without_a_state_and_in_two_chunks() -> None:
    x, A_log, Bm, Cm, D, dt, dt_bias, state = _inputs(2, 4, 2, 16, 32, mx.float32, seed=12, L=200)
    # No state: zeros, as mlx-lm's.
    want_y, want_state = _mlx_lm(x, A_log, Bm, Cm, D, dt, dt_bias, None)
    y, st = ssm_update_cpu(x, A_log, Bm, Cm, D, dt, dt_bias, None)
    _close(y, want_y, TOLERANCES[mx.float32])
    _close(st, want_state, TOLERANCES[mx.float32])
    zero_y, zero_st = ssm_update_cpu(x, A_log, Bm, Cm, D, dt, dt_bias, mx.zeros_like(state))
    assert mx.array_equal(zero_y, y).item() and mx.array_equal(zero_st, st).item()
    # A chunked prefill: 70 tokens, then 130 carrying the state, is the 200-token call.
    whole_y, whole_st = ssm_update_cpu(x, A_log, Bm, Cm, D, dt, dt_bias, state)
    a_y, a_st = ssm_update_cpu(x[:, :70], A_log, Bm[:, :70], Cm[:, :70], D, dt[:, :70], dt_bias, state)
    b_y, b_st = ssm_update_cpu(x[:, 70:], A_log, Bm[:, 70:], Cm[:, 70:], D, dt[:, 70:], dt_bias, a_st)
    _close(mx.concatenate([a_y, b_y], axis=1), whole_y, (1e-5, 1e-5))
    _close(b_st, whole_st, (1e-6, 1e-6))
    _close(whole_st, _mlx_lm(x, A_log, Bm, Cm, D, dt, dt_bias, state)[1], TOLERANCES[mx.float32])


def test_selfcheck_checks_and_routes_it() -> None:
    shapes = ModelShapes(4, 4, 64, 16, mx.float32, max_batch=4, ssm=(8, 2, 32, 64))
    assert OP.applies(shapes) and not OP.applies(ModelShapes(4, 2, 64, 16, mx.float32))
    labels = [c.label for c in OP.check_cases(shapes)]
    assert any("prefill" in lb and "masked" in lb for lb in labels) and any("no state" in lb for lb in labels)
    assert selfcheck.check_kernel(OP, OP.kernels["cpu"], shapes) is None
    sel = selfcheck.select_kernels(shapes, ops=[OP], timing_iters=1)
    report = next(r for r in sel.report.ops if r.op == "ssm_update")
    assert (sel.ssm_update is None) == (report.implementation == "reference"), report
    # A planted wrong kernel mismatches and is set aside: the model's own ssm_update runs.
    bad = OP.kernels["cpu"].__class__(lambda *a: (ssm_update_ref(*a)[0], ssm_update_ref(*a)[1] * 1.5))
    failure = selfcheck.check_kernel(OP, bad, shapes)
    assert failure is not None and "output 1" in failure
    # A scan that decays through masked tokens passes decode's cases but fails the ragged prefill.
    def no_mask(*a: object) -> tuple[mx.array, mx.array]:
        if a[0].shape[1] == 1:  # type: ignore[attr-defined]
            return ssm_update_cpu(*a)  # type: ignore[arg-type]
        return ssm_update_cpu(*a[:9])  # type: ignore[arg-type]
    failure = selfcheck.check_kernel(OP, OP.kernels["cpu"].__class__(no_mask), shapes)
    assert failure is not None and failure.startswith("prefill") and "masked" in failure, failure
    assert selfcheck.select_kernels(ModelShapes(4, 2, 64, 16, mx.float32), ops=[OP]).ssm_update is None


def test_engine_seam_routes_decode_and_prefill() -> None:
    from trillm.engine.fused_ops import _fused_ssm_update, fused_ops

    calls: list[int] = []

    def counting(*args: object) -> tuple[mx.array, mx.array]:
        calls.append(args[0].shape[1])  # type: ignore[attr-defined]
        return ssm_update_cpu(*args)  # type: ignore[arg-type]

    original = mlx_ssm.ssm_update
    fused = _fused_ssm_update(original)
    args = _inputs(2, 4, 1, 16, 32, mx.float32, seed=9)
    want = original(*args)
    assert not calls and mx.array_equal(fused(*args)[1], want[1]).item()  # outside fused_ops: mlx-lm's own
    x, A_log, Bm, Cm, D, dt, dt_bias, state = args
    x3, B3, C3, dt3 = (mx.concatenate([a] * 3, axis=1) for a in (x, Bm, Cm, dt))
    mask = _right_padded([3, 2], 3)
    with fused_ops(dataclasses.replace(selfcheck.unchecked(), ssm_update=counting)):
        got = fused(x, A_log, Bm, Cm, D, dt, dt_bias, state, (0.001, 100.0), mask=None, lengths=None)
        # Prefill (3 tokens), a call without a state, a ragged one given the mask alone (as Nemotron-H's
        # mixer calls it): the kernel, with the lengths the mask says.
        pre = fused(x3, A_log, B3, C3, D, dt3, dt_bias, state)
        fused(x, A_log, Bm, Cm, D, dt, dt_bias)
        ragged = fused(x3, A_log, B3, C3, D, dt3, dt_bias, state, (0.001, 100.0), mask)
    assert calls == [1, 3, 1, 3]
    for g, w in zip(got, want):
        _close(g, w, TOLERANCES[mx.float32])
    _close(pre[1], original(x3, A_log, B3, C3, D, dt3, dt_bias, state)[1], TOLERANCES[mx.float32])
    want_ragged = original(x3, A_log, B3, C3, D, dt3, dt_bias, state, (0.001, 100.0), mask, mx.array([3, 2]))
    _close(ragged[1], want_ragged[1], TOLERANCES[mx.float32])


# bfloat16 is left out: the emulator's numpy bridge has no bfloat16.
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("Ds", [64, 128])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_gpu_body_under_the_emulator(dtype: mx.Dtype, Ds: int, masked: bool) -> None:
    # The shared Metal/CUDA body, its template and grid as on a GPU, run by the g++ thread emulator against
    # the reference: grouped heads, masked tokens and rows that keep their state.
    kernel_emulator = _emulator()
    from trillm.kernels.ssm_update import ssm_update_kernel

    B, H, G, Dh = 4, 4, 2, 8
    args = list(_inputs(B, H, G, Dh, Ds, dtype, seed=5))
    mask = mx.array([[True], [False], [True], [False]]) if masked else None
    lengths = mx.array([1, 1, -1, -1]) if masked else None
    y, st = ssm_update_kernel(kernel_emulator.BACKEND, *args, mask=mask, lengths=lengths)
    want_y, want_st = ssm_update_ref(*args, mask=mask, lengths=lengths)
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(want_y.astype(mx.float32)),
                               rtol=tol[0], atol=tol[1])
    np.testing.assert_allclose(np.array(st), np.array(want_st.astype(mx.float32)), rtol=1e-4, atol=1e-4)


def test_gpu_body_scans_a_prefill_under_the_emulator() -> None:
    # The same body over 300 tokens (across ssm_attn's 256-token chunks): ragged right-padded rows as the
    # engine builds them (padding from the second chunk, a negative length), a left-padded row without
    # lengths, and no state; every position compared against mlx-lm's, padding too. (float16 inputs: the
    # decode cases above and the self-check's below.)
    kernel_emulator = _emulator()
    from trillm.kernels.ssm_update import ssm_update_kernel

    dtype = mx.float32
    args = list(_inputs(3, 2, 1, 4, 64, dtype, seed=13, L=300))
    right = (_right_padded([300, 270, 0], 300), mx.array([300, 270, -2]))
    left = (mx.arange(300)[None, :] >= mx.array([0, 17, 260])[:, None], None)
    for (mask, lengths), state in ((right, args[-1]), (left, args[-1]), ((None, None), None)):
        y, st = ssm_update_kernel(kernel_emulator.BACKEND, *args[:-1], state, mask=mask, lengths=lengths)
        want_y, want_st = _mlx_lm(*args[:-1], state, mask=mask, lengths=lengths)
        _close(y, want_y, TOLERANCES[dtype])
        _close(st, want_st, TOLERANCES[mx.float32])


def _emulator() -> ModuleType:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the CPU kernel emulator needs it")
    import kernel_emulator

    kernel_emulator.install()
    return kernel_emulator


def test_gpu_kernel_is_registered_for_metal_and_cuda() -> None:
    mamba2 = selfcheck.PRESETS["mamba2"]
    for backend in ("metal", "cuda"):
        kernel = OP.kernels[backend]
        assert kernel.fn is ssm_op.ssm_update_gpu and kernel.supports(mamba2) is None
        assert OP.kernel_for(backend, selfcheck.PRESETS["nemotron-h"]) is kernel  # grouped B and C
        odd = dataclasses.replace(mamba2, ssm=(8, 2, 16, 20))
        assert "not a multiple of 32" in (kernel.supports(odd) or "")
    # A call the body does not take (Ds off 32) runs the reference; off Metal, mlx-lm's own is its ops.
    args = _inputs(2, 6, 3, 8, 20, mx.float32, seed=3)
    want = ssm_update_ref(*args)
    for got in (ssm_op.ssm_update_gpu(*args), ssm_op.mlx_lm_own(*args)):
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


@pytest.fixture
def _cache(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(selfcheck.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv("TRILLM_KERNELS", raising=False)


def test_selfcheck_passes_the_emulated_body_and_sets_a_wrong_one_aside(
        _cache: None, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The emulated GPU body plugged in as this back-end's kernel passes every check case (grouped heads, a
    masked batch); a body that decays a masked token's state fails the masked case and the op falls back."""
    emu = _emulator()
    shapes = ModelShapes(4, 4, 64, 16, mx.float32, max_batch=4, ssm=(4, 2, 8, 32))
    monkeypatch.setitem(OP.kernels, "cpu", Kernel(partial(ssm_op.ssm_update_on, emu.BACKEND)))
    report = selfcheck.select_kernels(shapes, ops=[OP], timing_iters=1).report
    assert not report.ops[0].failed and report.ops[0].reason.startswith("checked"), report.ops[0]
    # masked tokens scanned as if they were not: decayed, and given their input
    plant = dataclasses.replace(ssm_op.SSM, body=ssm_op.SSM.body.replace("if (HAS_MASK && mask[tok] == 0)",
                                                                         "if (false)"))
    assert plant.body != ssm_op.SSM.body
    monkeypatch.setattr(ssm_op, "SSM", plant)
    with pytest.warns(selfcheck.KernelFallbackWarning, match="ssm_update"):
        sel = selfcheck.select_kernels(dataclasses.replace(shapes, max_batch=5), ops=[OP], timing_iters=1)
    assert sel.ssm_update is None and sel.report.ops[0].failed and "masked" in sel.report.ops[0].reason
