"""trillm's CPU extension (kernels/cpu/): each primitive against its reference on the GPU kernels' grid,
the dispatcher's choice, and the build: cached, rebuilt from a clean cache, and a failed build falling back."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from paged_cases import TOLERANCES, make_case
from trillm.kernels import cpu_ext
import importlib

pa = importlib.import_module("trillm.kernels.paged_attention")  # the module (the package re-exports the function)
from trillm.kernels.paged_attention import paged_attention, paged_attention_cpu, paged_attention_ref
from trillm.kernels.linear import linear_cpu, linear_ref
from trillm.kernels.rms_norm import rms_norm_cpu, rms_norm_ref
from trillm.kernels.rope import rope_cpu, rope_ref
from trillm.kernels.silu_mul import silu_mul_cpu, silu_mul_ref

# The suite must test the kernels it ships: a missing extension fails here unless it was turned off on purpose.
pytestmark = pytest.mark.skipif(
    os.environ.get(cpu_ext.DISABLE_ENV, "").lower() in ("0", "off", "false", "no"),
    reason=f"{cpu_ext.DISABLE_ENV} turns the CPU extension off",
)
PARTITION = 512  # the GPU kernels' and the CPU primitive's context partition


@pytest.fixture(scope="module")
def ext() -> object:
    module = cpu_ext.load()
    assert module is not None, f"the CPU extension did not load: {cpu_ext.status().reason}"
    assert module.PARTITION_SIZE == PARTITION
    return module


def _lens(bs: int, num_queries: int, long: bool) -> list[int]:
    lens = [bs, bs + 1, 2 * bs + 7, 3 * bs, max(1, num_queries)]
    return lens + [PARTITION * 2 + 5] if long else lens  # three partitions: the split plus the reduction


def _assert_close(got: mx.array, want: mx.array, dtype: mx.Dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rep", [1, 3, 4, 8])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("window, with_sinks, long", [(None, False, False), (None, False, True), (37, True, True)])
def test_paged_attention_cpu_matches_reference(ext: object, num_queries: int, bs: int, rep: int, d: int,
                                               dtype: mx.Dtype, window: int | None, with_sinks: bool,
                                               long: bool) -> None:  # fmt: skip
    case = make_case(_lens(bs, num_queries, long), bs=bs, hkv=2, rep=rep, d=d, num_queries=num_queries, dtype=dtype)
    sinks = mx.array(np.linspace(-1, 1, 2 * rep, dtype=np.float32)) if with_sinks else None
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    want = paged_attention_ref(*args, scale=d**-0.5, window=window, sinks=sinks)
    got = paged_attention_cpu(*args, scale=d**-0.5, window=window, sinks=sinks)
    assert got.shape == want.shape and got.dtype == want.dtype
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d, rep", [(64, 1), (64, 4), (128, 3), (96, 2)])  # 96: the any-D path
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("window, with_sinks, softcap", [(None, False, 1.5), (37, True, 2.0), (None, True, 30.0)],
                         ids=["softcap", "softcap-window-sinks", "softcap-sinks-wide"])
def test_paged_attention_cpu_softcap(ext: object, num_queries: int, d: int, rep: int, dtype: mx.Dtype,
                                     window: int | None, with_sinks: bool, softcap: float) -> None:  # fmt: skip
    """Soft-capping (Gemma 2) alone and with the other variants, through the split-K partitions and reduction."""
    case = make_case(_lens(16, num_queries, True), bs=16, hkv=2, rep=rep, d=d, num_queries=num_queries, dtype=dtype,
                     seed=7)  # fmt: skip
    sinks = mx.array(np.linspace(-1, 1, 2 * rep, dtype=np.float32)) if with_sinks else None
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    kw = dict(scale=0.3, window=window, sinks=sinks, softcap=softcap)
    got = paged_attention_cpu(*args, **kw)  # type: ignore[arg-type]
    _assert_close(got, paged_attention_ref(*args, **kw), dtype)  # type: ignore[arg-type]
    if softcap < 10:  # the cap bends these scores: a kernel ignoring it would fail the comparison above
        uncapped = paged_attention_ref(*args, scale=0.3, window=window, sinks=sinks)
        assert float(mx.max(mx.abs(uncapped.astype(mx.float32) - got.astype(mx.float32))).item()) > 0.05


@pytest.mark.parametrize("num_queries", [40, 70], ids=["one-tile-per-row-group", "ragged-tiles"])
def test_paged_attention_cpu_long_prefill_chunk(ext: object, num_queries: int) -> None:
    # Query tiles of several queries x heads, a chunk crossing partitions, and a cached prefix before it.
    case = make_case([PARTITION + 90, num_queries, 700], bs=16, hkv=3, rep=3, d=64, num_queries=num_queries,
                     dtype=mx.float32)  # fmt: skip
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    _assert_close(paged_attention_cpu(*args, scale=0.125), paged_attention_ref(*args, scale=0.125), mx.float32)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the dispatcher's calls into the CPU primitive."""
    calls: list[int] = []
    real = pa.paged_attention_cpu

    def counted(*args: object, **kwargs: object) -> mx.array:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setitem(pa.KERNELS, "cpu", dataclasses.replace(pa.KERNELS["cpu"], fn=counted))
    return calls


def test_dispatcher_runs_the_cpu_primitive_unless_references_are_forced(ext: object,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([20, 33], bs=16, hkv=1, rep=3, d=64, num_queries=1, dtype=mx.float32)
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
    calls = _spy(monkeypatch)
    out = paged_attention(*args, scale=0.125)
    assert len(calls) == 1
    monkeypatch.setenv("TRILLM_KERNELS", "ref")
    ref = paged_attention(*args, scale=0.125)
    assert len(calls) == 1
    _assert_close(out, ref, mx.float32)


def test_cache_key_follows_the_sources(tmp_path: Path) -> None:
    for src in cpu_ext.source_files():
        (tmp_path / src.name).write_bytes(src.read_bytes())
    key = cpu_ext.cache_key(tmp_path)
    assert key == cpu_ext.cache_key(cpu_ext.SOURCE_DIR)
    (tmp_path / "thread_pool.cpp").write_text((tmp_path / "thread_pool.cpp").read_text() + "\n// changed\n")
    assert cpu_ext.cache_key(tmp_path) != key


def test_failed_build_falls_back_to_the_references_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setenv(cpu_ext.CACHE_ENV, str(tmp_path))  # an empty cache: the build must run, and fails
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))  # no cmake, no compiler
    with pytest.raises(cpu_ext.BuildError, match="not found"):
        cpu_ext.build()
    cpu_ext._load.cache_clear()
    calls = _spy(monkeypatch)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            case = make_case([20, 33], bs=16, hkv=1, rep=3, d=64, num_queries=1, dtype=mx.float32)
            args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens)
            outs = [paged_attention(*args, scale=0.125) for _ in range(3)]
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "running the pure-mx references" in msgs[0] and "not found" in msgs[0], msgs
        assert not cpu_ext.status().available and cpu_ext.load() is None
        assert not calls
        _assert_close(outs[0], paged_attention_ref(*args, scale=0.125), mx.float32)
    finally:
        cpu_ext._load.cache_clear()  # the next user loads the real, cached extension again


def test_the_setup_built_extension_is_the_one_loaded() -> None:
    # A clean clone builds it in `dev.sh setup` (what CI runs), from these very sources: a cache key that
    # missed a source file or a flag would load a stale build here.
    status = cpu_ext.status()
    assert status.available, status.reason
    assert status.path is not None and status.path.parent.name == cpu_ext.cache_key()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (2, 5, 3, 128), (300, 96)])
def test_rms_norm_cpu_matches_reference(ext: object, shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    x = (mx.random.normal(shape, key=mx.random.key(1)) * 3).astype(dtype)
    w = mx.random.normal((shape[-1],), key=mx.random.key(2)).astype(dtype)
    got = rms_norm_cpu(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    _assert_close(got, rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("traditional", [True, False], ids=["traditional", "half-split"])
@pytest.mark.parametrize("offset", [0, 37, "per-row"])
@pytest.mark.parametrize("layout", ["head-major view", "contiguous", "3-d", "partial dims"])
def test_rope_cpu_matches_reference(ext: object, layout: str, offset: int | str, traditional: bool,
                                    dtype: mx.Dtype) -> None:  # fmt: skip
    B, L, H, D = 3, 5, 4, 64
    base = mx.random.normal((B, L, H, D), key=mx.random.key(3)).astype(dtype)
    x = base.transpose(0, 2, 1, 3)  # what mlx-lm's attention passes: a strided view
    dims = D
    if layout == "contiguous":
        x = mx.contiguous(x)
    elif layout == "3-d":
        x = base[:, :, 0, :]
    elif layout == "partial dims":
        dims = 32
    off: int | mx.array = mx.array([3, 900, 2048], mx.int32) if offset == "per-row" else int(offset)
    kw = dict(traditional=traditional, base=10000.0, scale=1.0, offset=off)
    got = rope_cpu(x, dims, **kw)  # type: ignore[arg-type]
    want = rope_ref(x, dims, **kw)  # type: ignore[arg-type]
    assert got.shape == want.shape and got.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    if offset == "per-row" and dtype == mx.float32:
        # At position ~2k the float32 angle itself is off by ~1e-4 rad: both differ from a float64 truth by that
        # much (the reference more: 2.4e-4 vs 1.5e-4), so they can only agree to about twice it.
        atol = 5e-4
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol,
                               rtol=rtol)  # fmt: skip


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 1536), (2, 33, 1536), (7, 3)])
def test_silu_mul_cpu_matches_reference(ext: object, shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    gate = (mx.random.normal(shape, key=mx.random.key(4)) * 6).astype(dtype)  # both tails of the sigmoid
    up = mx.random.normal(shape, key=mx.random.key(5)).astype(dtype)
    got = silu_mul_cpu(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype
    _assert_close(got, silu_mul_ref(gate, up), dtype)


# 1-8: dot-product tiles; 9-16 and 17-32: the transposed broadcast path (one and two vectors of rows, padded
# rows inside a vector); past 32: several 32-row blocks sharing a weight band.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 24, 31, 32, 33, 50, 64])
@pytest.mark.parametrize("n, k", [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 64), (37, 48)])
def test_linear_cpu_matches_blas(ext: object, rows: int, n: int, k: int) -> None:
    x = mx.random.normal((rows, 1, k), key=mx.random.key(6))
    w = mx.random.normal((n, k), key=mx.random.key(7)) / k**0.5
    got = linear_cpu(x, w)
    assert got.shape == (rows, 1, n)
    _assert_close(got, linear_ref(x, w), mx.float32)


@pytest.mark.parametrize("rows", [4, 20])
def test_linear_cpu_reads_row_slices_and_transposed_weights(ext: object, rows: int) -> None:
    """The engine's stacked q/k/v weights are row slices of one buffer (read through the row stride); any
    other layout is copied row-major inside the task."""
    packed = mx.random.normal((960, 576), key=mx.random.key(8)) / 24
    x = mx.random.normal((rows, 1, 576), key=mx.random.key(9))
    for w in (packed[576:768], packed[:576, :192].T):
        _assert_close(linear_cpu(x, w), linear_ref(x, w), mx.float32)


def test_linear_dispatch_keeps_many_rows_on_blas(ext: object, monkeypatch: pytest.MonkeyPatch) -> None:
    lin = importlib.import_module("trillm.kernels.linear")
    calls: list[int] = []
    real = lin.linear_cpu
    monkeypatch.setattr(lin, "linear_cpu", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    w = mx.random.normal((64, 32))
    for rows in (1, lin.MAX_ROWS, lin.MAX_ROWS + 1, 512):
        lin.linear(mx.random.normal((rows, 32)), w)
    assert calls == [1, lin.MAX_ROWS]
