"""`trillm bench tp`'s arithmetic: the ring all_sum cost model, the N-machine estimate, and refusing empty data."""

from __future__ import annotations

import math

import pytest

from trillm.bench.tp import _check, predict, ring_all_sum_s


def test_ring_all_sum_cost_is_2_n_minus_1_hops_of_a_1_over_n_slice() -> None:
    assert ring_all_sum_s(4096, 2, 50e-6, 1.25e9) == pytest.approx(2 * (50e-6 + 2048 / 1.25e9))
    assert ring_all_sum_s(3000, 3, 0.0, 1e9) == pytest.approx(4 * 1000 / 1e9)


def test_prediction_splits_only_the_sharded_weights() -> None:
    engine = {"num_layers": 30, "hidden": 576, "weight_bytes": 1000, "sharded_bytes": 800, "plan_capacity": 4096,
              "rows": [{"batch": 1, "step_ms_1": 60.0, "step_ms_n": 300.0}]}
    coll = {"rows": [{"batch": 1, "step_us": 9000.0}]}
    (row,) = predict(engine, coll, 2, 50.0, 10.0)
    assert row["compute_ms"] == pytest.approx(60.0 * (0.2 + 0.8 / 2))
    link = 60 * ring_all_sum_s(4 * 576, 2, 50e-6, 1.25e9) + ring_all_sum_s(4 * 4096, 2, 50e-6, 1.25e9)
    assert row["comm_ms"] == pytest.approx(1e3 * link)
    assert row["speedup"] == pytest.approx(60.0 / (row["compute_ms"] + row["comm_ms"]))
    assert row["loopback_comm_ms"] == 9.0


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, None])
def test_a_measurement_of_nothing_fails_loudly(value: object) -> None:
    with pytest.raises(SystemExit, match="measured nothing"):
        _check(value, "x")
