"""`trillm bench profile-ops` on a 4-bit tiny model: the self-check it reports is the engine's (quant_linear
checked), and its graph-building figure is Python alone (the forward's early-compute kicks switched off)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import trillm.kernels  # noqa: F401  (BLAS before mlx)

from trillm.bench import cli


def test_profile_ops_checks_quant_linear_on_a_quantized_model(tiny_model_path: Path, tmp_path: Path) -> None:
    from mlx_lm.utils import load_model as mlx_load_model, quantize_model, save_model

    model, config = mlx_load_model(tiny_model_path)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    folder = Path(shutil.copytree(tiny_model_path, tmp_path / "tiny-q4", ignore=shutil.ignore_patterns("*.safetensors")))
    save_model(folder, model)
    (folder / "config.json").write_text(json.dumps(config))
    rc = cli.main(["profile-ops", "--model", str(folder), "--cases", "decode:2x40", "--iters", "2",
                   "--results", str(tmp_path / "results")])
    assert rc == 0
    doc = json.loads(next((tmp_path / "results").rglob("profile_ops.json")).read_text())
    ops = {r["op"]: r for r in doc["self_check"]["ops"]}
    assert "quant_linear" in ops and ops["quant_linear"]["reason"].startswith("checked")
    (case,) = doc["kernels"]
    # Building the graph alone is cheaper than the step that also computes it.
    assert 0 < case["graph_build_ms"] < case["step_ms"]
