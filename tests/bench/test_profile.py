"""`trillm bench profile` on the tiny model: a sample for every shape it was asked to time."""

from __future__ import annotations

import json
from pathlib import Path

from trillm.bench import cli
from trillm.engine.mock import LinearCostModel


def test_profile_has_samples_for_every_requested_shape(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    rc = cli.main(["profile", "--model", str(tiny_model_path), "--batches", "1,3", "--contexts", "16,40",
                   "--chunks", "8,24", "--num-chunks", "2", "--steps", "3", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    decode = {(s["batch"], s["context"]) for s in doc["decode"]}
    assert decode == {(b, c) for b in (1, 3) for c in (16, 40)}
    assert all(s["seconds"] > 0 for s in doc["decode"] + doc["prefill"])
    assert {s["tokens"] for s in doc["prefill"]} == {8, 24}
    assert {s["start"] for s in doc["prefill"] if s["tokens"] == 8} == {0, 8}
    assert LinearCostModel(**doc["linear_fit"]) != LinearCostModel()  # fitted to the samples, not the defaults
