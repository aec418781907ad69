"""The model modules' `nn` after install_fused_ops: mlx.nn for every name, but `silu` through the selection's
`silu_mul` inside fused_ops() (MLX's own outside it, and where the selection runs the reference)."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn

from tests import model_zoo as zoo
from trillm.engine.fused_ops import FusedNn, fused_ops, install_fused_ops
from trillm.kernels import selfcheck
from trillm.kernels.silu_mul import silu_mul_cpu_kernel, silu_mul_ref


def test_model_modules_silu_runs_the_selection_inside_fused_ops() -> None:
    family = next(f for f in zoo.FAMILIES if f.model_type == "mamba2")
    config = zoo.family_config(family)
    model_class, args_class = zoo.model_classes(config)
    model = model_class(args_class.from_dict(config))
    install_fused_ops(model)
    mod = sys.modules[type(model).__module__]
    assert isinstance(mod.nn, FusedNn) and mod.nn.Module is nn.Module and mod.nn.Linear is nn.Linear
    assert sys.modules["trillm.engine.fused_ops"].nn is nn  # only mlx-lm's modules
    calls: list[int] = []

    def counting(gate: mx.array, up: mx.array) -> mx.array:
        calls.append(1)
        return silu_mul_cpu_kernel(gate, up)

    x = mx.random.normal((3, 5, 40), key=mx.random.key(1))
    want = nn.silu(x)
    assert mx.array_equal(mod.nn.silu(x), want).item() and not calls  # outside fused_ops: MLX's own
    with fused_ops(dataclasses.replace(selfcheck.unchecked(), silu_mul=counting)):
        got = mod.nn.silu(x)
        model(mx.array([[1, 2, 3]]))  # the mixer's conv output goes through it
    assert len(calls) >= 2
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=2e-5)
    with fused_ops(dataclasses.replace(selfcheck.unchecked(), silu_mul=silu_mul_ref)):
        assert mx.array_equal(mod.nn.silu(x), want).item()
    install_fused_ops(model)  # idempotent
    assert isinstance(mod.nn, FusedNn) and not isinstance(mod.nn.__trillm_original__, FusedNn)
