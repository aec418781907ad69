"""Packing arrays into one huge-page buffer keeps their shapes and values."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from trillm.kernels import hugepages


def test_pack_keeps_shapes_and_values() -> None:
    arrays = [mx.random.normal(s, key=mx.random.key(i)) for i, s in enumerate([(3, 5), (1024, 600), (7,), (1500, 64)])]
    views, advice = hugepages.pack(arrays)
    assert [v.shape for v in views] == [a.shape for a in arrays]
    for v, a in zip(views, arrays):
        np.testing.assert_array_equal(np.array(v), np.array(a))
    assert advice.nbytes >= sum(a.nbytes for a in arrays)
    if hugepages.available():  # the buffer (~4 MB) holds at least one whole 2 MiB page
        assert advice.advised > 0 or advice.error


def test_pack_refuses_mixed_dtypes() -> None:
    with pytest.raises(ValueError):
        hugepages.pack([mx.zeros((4,)), mx.zeros((4,), mx.float16)])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are requested on Linux only")
def test_advise_says_why_not_for_a_small_array() -> None:
    if not hugepages.available():
        pytest.skip("trillm's CPU extension is unavailable")
    advice = hugepages.advise(mx.zeros((16,)))
    assert advice.advised == 0 and advice.error == "smaller than one 2 MiB page"
