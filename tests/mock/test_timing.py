"""Timing models: Dynamo's worked numbers, the roofline's shape, and the fit recovering known coefficients."""

from __future__ import annotations

from pathlib import Path

import pytest

from trillm.engine.mock.model import MockModelSpec
from trillm.engine.mock.timing import (
    DecodeSample, InterpolatedModel, LinearCostModel, PolynomialModel, PrefillSample, StepShape, load_perf_model,
    save_profile,
)


def test_polynomial_matches_dynamo_worked_numbers() -> None:
    m = PolynomialModel()
    assert m.step_seconds(StepShape(prefill_chunks=((1000, 0),))) * 1000 == pytest.approx(32.1, abs=0.05)
    assert m.step_seconds(StepShape(prefill_chunks=((8192, 0),))) * 1000 == pytest.approx(169.1, abs=0.05)
    assert m.step_seconds(StepShape(decode_contexts=(10,), kv_usage=0.5)) * 1000 == pytest.approx(26.3, abs=0.05)
    assert m.step_seconds(StepShape()) == 0.0


def test_roofline_decode_reads_weights_plus_kv() -> None:
    spec = MockModelSpec()
    m = spec.roofline(mem_bandwidth_gbps=100.0, step_overhead_s=0.0, per_seq_overhead_s=0.0)
    one = m.step_seconds(StepShape(decode_contexts=(1000,)))
    assert one == pytest.approx((spec.weight_bytes + 1000 * spec.kv_bytes_per_token) / 100e9)
    # more sequences or longer contexts only cost more
    assert m.step_seconds(StepShape(decode_contexts=(1000, 1000))) > one
    assert m.step_seconds(StepShape(decode_contexts=(2000,))) > one
    # a mixed step pays the chunk after the decode
    mixed = StepShape(decode_contexts=(1000,), prefill_chunks=((256, 0),))
    assert m.step_seconds(mixed) == pytest.approx(one + m.prefill_seconds(256, 0))


def test_fit_recovers_known_coefficients(tmp_path: Path) -> None:
    truth = LinearCostModel(3e-3, 4e-4, 2e-7, 5e-3, 2e-4, 3e-9)
    decode = [DecodeSample(b, c, truth.decode_seconds(b, b * c)) for b in (1, 2, 4, 8, 16) for c in (64, 512, 2048)]
    prefill = [PrefillSample(n, s, truth.prefill_seconds(n, s)) for n in (16, 128, 512) for s in (0, 1024)]
    fit = save_profile(tmp_path / "p.json", decode, prefill, {"what": "test"})
    for got, want in zip(
        (fit.decode_base_s, fit.decode_per_seq_s, fit.decode_per_ctx_token_s, fit.prefill_base_s,
         fit.prefill_per_token_s, fit.prefill_per_attn_s),
        (3e-3, 4e-4, 2e-7, 5e-3, 2e-4, 3e-9),
    ):
        assert got == pytest.approx(want, rel=1e-6)
    assert load_perf_model(tmp_path / "p.json") == fit
    interp = load_perf_model(tmp_path / "p.json", "interpolated")
    assert isinstance(interp, InterpolatedModel)
    # on the grid the interpolation returns the measurement; between points it stays between them
    assert interp.step_seconds(StepShape(decode_contexts=(512,) * 4)) == pytest.approx(truth.decode_seconds(4, 2048))
    mid = interp.step_seconds(StepShape(decode_contexts=(512,) * 3))
    assert truth.decode_seconds(2, 1024) < mid < truth.decode_seconds(4, 2048)
    assert interp.step_seconds(StepShape(prefill_chunks=((128, 1024),))) == pytest.approx(truth.prefill_seconds(128, 1024))


def test_fit_never_returns_negative_coefficients() -> None:
    # noisy, decreasing-with-batch data would give a negative slope in plain least squares
    decode = [DecodeSample(b, 100, 0.01 - 1e-4 * b) for b in range(1, 9)]
    fit = LinearCostModel.fit(decode, [])
    assert min(fit.decode_base_s, fit.decode_per_seq_s, fit.decode_per_ctx_token_s) >= 0.0
