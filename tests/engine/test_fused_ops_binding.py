"""The fused ops' argument binding: the direct mapping agrees with inspect.Signature.bind + apply_defaults on
mlx-lm's ssm_update and gated_delta_update, and any other call shape still goes through bind (and its errors)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
from mlx_lm.models.gated_delta import gated_delta_update
from mlx_lm.models.ssm import ssm_update

from trillm.engine.fused_ops import _binder

_CALLS: list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]] = [
    (ssm_update, tuple(range(7)), {}),
    (ssm_update, tuple(range(11)), {}),
    (ssm_update, tuple(range(8)), {"mask": "m", "lengths": "l"}),
    (ssm_update, (0,), {"A_log": 1, "B": 2, "C": 3, "D": 4, "dt": 5, "dt_bias": 6}),
    (gated_delta_update, tuple(range(9)), {"use_kernel": False}),
    (gated_delta_update, tuple(range(7)), {}),
    (gated_delta_update, tuple(range(7)), {"mask": "m", "lower_bound": 0.5, "allow_neg_eigval": True}),
]


@pytest.mark.parametrize(("fn", "args", "kwargs"), _CALLS)
def test_matches_signature_bind(fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    assert _binder(sig)(args, kwargs) == dict(bound.arguments)


@pytest.mark.parametrize(("args", "kwargs"), [((0, 1), {}), (tuple(range(12)), {}), (tuple(range(7)), {"A_log": 1}),
                                              (tuple(range(7)), {"nope": 1})])
def test_bad_calls_raise_as_bind_does(args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    with pytest.raises(TypeError):
        _binder(inspect.signature(ssm_update))(args, kwargs)
