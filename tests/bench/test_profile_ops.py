"""`trillm bench profile-ops` on a 4-bit tiny model: the self-check it reports is the engine's (quant_linear
checked), and its graph-building figure is Python alone (the forward's early-compute kicks switched off)."""

from __future__ import annotations

import json
from pathlib import Path

import trillm.kernels  # noqa: F401  (BLAS before mlx)

from trillm.bench import cli


def test_profile_ops_checks_quant_linear_on_a_quantized_model(tiny_q4_model_path: Path, tmp_path: Path) -> None:
    folder = tiny_q4_model_path
    rc = cli.main(["profile-ops", "--model", str(folder), "--cases", "decode:2x40", "--iters", "2",
                   "--results", str(tmp_path / "results")])
    assert rc == 0
    doc = json.loads(next((tmp_path / "results").rglob("profile_ops.json")).read_text())
    ops = {r["op"]: r for r in doc["self_check"]["ops"]}
    assert "quant_linear" in ops and ops["quant_linear"]["reason"].startswith("checked")
    (case,) = doc["kernels"]
    # Building the graph alone is cheaper than the step that also computes it.
    assert 0 < case["graph_build_ms"] < case["step_ms"]
