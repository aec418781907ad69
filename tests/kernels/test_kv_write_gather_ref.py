"""kv_write / kv_gather references: round trips against the dense data they came from."""

from __future__ import annotations

import numpy as np
import pytest

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import kv_gather, kv_write
from trillm.kernels.kv_gather import kv_gather_ref
from trillm.kernels.kv_write import kv_write_ref


def _slots(tables: np.ndarray, b: int, positions: range, bs: int) -> np.ndarray:
    return np.array([tables[b, p // bs] * bs + p % bs for p in positions], np.int32)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("bs", [16, 32])
def test_write_then_gather_round_trip(bs: int, dtype: mx.Dtype) -> None:
    """Prefill chunks then decode steps, written by slot mapping, read back through the tables exactly."""
    rng = np.random.default_rng(0)
    hkv, d, lens = 3, 64, [1, bs, bs + 1, 3 * bs - 1]
    num_blocks = 1 + sum(-(-n // bs) for n in lens) + 2
    k_pool = mx.zeros((num_blocks, bs, hkv, d), dtype=dtype)
    v_pool = mx.zeros_like(k_pool)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(lens), max(-(-n // bs) for n in lens)), np.int32)
    for b, n in enumerate(lens):
        tables[b, : -(-n // bs)] = [free.pop() for _ in range(-(-n // bs))]
    dense_k = [rng.standard_normal((n, hkv, d)).astype(np.float32) for n in lens]
    dense_v = [rng.standard_normal((n, hkv, d)).astype(np.float32) for n in lens]
    # Step 1: every row's prompt but its last token (one batched write); step 2: the last tokens.
    for lo_hi in (lambda n: range(0, n - 1), lambda n: range(n - 1, n)):
        slots = np.concatenate([_slots(tables, b, lo_hi(n), bs) for b, n in enumerate(lens)])
        keys = np.concatenate([dense_k[b][lo_hi(n)] for b, n in enumerate(lens)])
        vals = np.concatenate([dense_v[b][lo_hi(n)] for b, n in enumerate(lens)])
        k_pool, v_pool = kv_write(k_pool, v_pool, mx.array(keys).astype(dtype), mx.array(vals).astype(dtype),
                                  mx.array(slots))  # fmt: skip
    max_len = max(lens)
    for pool, dense in ((k_pool, dense_k), (v_pool, dense_v)):
        got = kv_gather(pool, mx.array(tables), max_len)
        assert got.shape == (len(lens), hkv, max_len, d) and got.dtype == dtype
        for b, n in enumerate(lens):
            want = mx.array(dense[b]).astype(dtype).transpose(1, 0, 2)
            assert mx.array_equal(got[b, :, :n], want)


def test_write_leaves_other_slots_alone() -> None:
    k_pool = mx.arange(4 * 16 * 2 * 32, dtype=mx.float32).reshape(4, 16, 2, 32)
    before = np.array(k_pool)
    new = mx.full((2, 2, 32), -1.0)
    k2, v2 = kv_write_ref(k_pool, k_pool, new, new, mx.array([17, 63], dtype=mx.int32))
    got = np.array(k2).reshape(-1, 2, 32)
    expect = before.reshape(-1, 2, 32).copy()
    expect[[17, 63]] = -1.0
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("max_len", [1, 16, 17, 40])
def test_gather_lengths(max_len: int) -> None:
    pool = mx.arange(6 * 16 * 1 * 32, dtype=mx.float32).reshape(6, 16, 1, 32)
    tables = mx.array([[3, 1, 5], [2, 4, 0]], dtype=mx.int32)
    got = np.array(kv_gather_ref(pool, tables, max_len))
    flat = np.array(pool).reshape(-1, 1, 32)
    for b in range(2):
        slots = [int(tables[b, p // 16]) * 16 + p % 16 for p in range(max_len)]
        np.testing.assert_array_equal(got[b], flat[slots].transpose(1, 0, 2))
    with pytest.raises(ValueError):
        kv_gather_ref(pool, tables, 49)
