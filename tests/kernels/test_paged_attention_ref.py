"""paged_attention_ref against mx.fast SDPA on the equivalent contiguous inputs, over shapes, dtypes, ragged rows."""

from __future__ import annotations

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels.paged_attention import paged_attention, paged_attention_ref
from paged_cases import TOLERANCES, dense_truth, make_case, numpy_truth

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _lens(bs: int, num_queries: int) -> list[int]:
    # ragged; exactly at and one past block boundaries; a single-token row for decode
    return [bs, bs + 1, 2 * bs + 7, 3 * bs, 1 if num_queries == 1 else num_queries]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rep", [1, 3, 4, 8])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
def test_matches_contiguous_sdpa(num_queries: int, bs: int, rep: int, d: int, dtype: mx.Dtype) -> None:
    case = make_case(_lens(bs, num_queries), bs=bs, hkv=2, rep=rep, d=d, num_queries=num_queries, dtype=dtype)
    scale = d**-0.5
    out = paged_attention_ref(case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, scale=scale)
    assert out.dtype == dtype and out.shape == case.q.shape
    truth = dense_truth(case, scale=scale, window=None, sinks=None)
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(truth), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("num_queries", [1, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("window, with_sinks", [(7, False), (None, True), (16, True), (1, False)])
def test_window_and_sinks(window: int | None, with_sinks: bool, num_queries: int, dtype: mx.Dtype) -> None:
    case = make_case([16, 17, 40, 9], bs=16, hkv=2, rep=3, d=64, num_queries=num_queries, dtype=dtype, seed=1)
    sinks = mx.array(np.linspace(-1.0, 2.0, 6, dtype=np.float32)) if with_sinks else None
    out = paged_attention_ref(
        case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, scale=0.125, window=window, sinks=sinks
    )
    truth = dense_truth(case, scale=0.125, window=window, sinks=sinks)
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(truth), atol=atol, rtol=rtol)


def test_sdpa_truth_agrees_with_numpy_softmax() -> None:
    """The truth above leans on mx.fast's sinks/mask semantics: check them against written-out softmax."""
    case = make_case([20, 33], bs=16, hkv=1, rep=4, d=64, num_queries=3, dtype=mx.float32, seed=2)
    sinks = np.array([0.5, -1.0, 3.0, 0.0], np.float32)
    truth = dense_truth(case, scale=0.2, window=9, sinks=mx.array(sinks))
    np.testing.assert_allclose(np.array(truth), numpy_truth(case, scale=0.2, window=9, sinks=sinks), atol=1e-5)


def test_dispatcher_runs_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([5, 40], bs=16, hkv=2, rep=2, d=64, num_queries=1, dtype=mx.float32)
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    monkeypatch.setenv("TRILLM_KERNELS", "ref")
    forced = paged_attention(*args, scale=0.125)
    assert mx.array_equal(forced, paged_attention_ref(*args, scale=0.125))


def test_bad_window_is_a_typed_error() -> None:
    case = make_case([5], bs=16, hkv=1, rep=1, d=64, num_queries=1, dtype=mx.float32)
    with pytest.raises(ValueError):
        paged_attention_ref(case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, scale=1.0, window=0)


# (window, sinks, softcap): soft-capping alone and with every other variant. A cap of 1.5 on scores of
# spread ~1-3 bends most logits, so a kernel that skipped or misplaced it is far outside the tolerance.
SOFTCAP_VARIANTS = [(None, False, 1.5), (7, False, 1.5), (None, True, 2.0), (16, True, 1.5), (1, False, 3.0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("num_queries", [1, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("window, with_sinks, softcap", SOFTCAP_VARIANTS)
def test_softcap_matches_gemma2(window: int | None, with_sinks: bool, softcap: float, num_queries: int,
                                dtype: mx.Dtype) -> None:  # fmt: skip
    case = make_case([16, 17, 40, 9], bs=16, hkv=2, rep=3, d=64, num_queries=num_queries, dtype=dtype, seed=4)
    sinks = mx.array(np.linspace(-1.0, 2.0, 6, dtype=np.float32)) if with_sinks else None
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    out = paged_attention_ref(*args, scale=0.25, window=window, sinks=sinks, softcap=softcap)
    assert out.dtype == dtype and out.shape == case.q.shape
    truth = dense_truth(case, scale=0.25, window=window, sinks=sinks, softcap=softcap)
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(truth), atol=atol, rtol=rtol)
    if window != 1:  # (a window of 1 sees one token: every softmax is 1, capped or not)
        uncapped = paged_attention_ref(*args, scale=0.25, window=window, sinks=sinks)
        assert float(mx.max(mx.abs(uncapped.astype(mx.float32) - truth)).item()) > 0.05  # the cap matters here


def test_gemma2_truth_agrees_with_numpy_softmax() -> None:
    case = make_case([20, 33], bs=16, hkv=1, rep=4, d=64, num_queries=3, dtype=mx.float32, seed=5)
    sinks = np.array([0.5, -1.0, 3.0, 0.0], np.float32)
    for s in (None, sinks):
        truth = dense_truth(case, scale=0.3, window=9, sinks=None if s is None else mx.array(s), softcap=2.0)
        np.testing.assert_allclose(np.array(truth), numpy_truth(case, scale=0.3, window=9, sinks=s, softcap=2.0),
                                   atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("softcap", [0.0, -1.0])
def test_bad_softcap_is_a_typed_error(softcap: float) -> None:
    case = make_case([5], bs=16, hkv=1, rep=1, d=64, num_queries=1, dtype=mx.float32)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention_ref(case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, scale=1.0,
                            softcap=softcap)  # fmt: skip
