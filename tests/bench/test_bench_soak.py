"""`trillm bench soak` end to end on a short run against `trillm serve --mock`; it fails when it measured nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trillm.bench import cli


def test_a_short_soak_meets_its_targets_and_writes_its_figures(tmp_path: Path) -> None:
    code = cli.main(["soak", "--mock", "--duration", "4", "--warmup", "1", "--clients", "6", "--disconnect", "0.3",
                     "--max-tokens", "4,16", "--results-dir", str(tmp_path)])
    (run,) = tmp_path.iterdir()
    res = json.loads((run / "soak.json").read_text())
    assert code == 0, res
    assert res["completed"] > 10 and res["disconnects"] > 0 and res["5xx"] == 0
    assert res["after"] == {**res["after"], "live_requests": 0, "running": 0, "waiting": 0, "kv_blocks_used": 0}
    assert res["after"]["outcomes"]["abort"] > 0  # the disconnects reached the engine
    assert res["rss_mb"]["growth_after_warmup"] is not None and res["well_behaved"]["e2e_p99_s"] > 0
    assert (run / "meta.json").is_file() and (run / "server.log").is_file()


def test_a_soak_that_measured_nothing_fails(tmp_path: Path) -> None:
    # The warm-up never ends within the run: there is no RSS growth to report, so the run must not pass.
    code = cli.main(["soak", "--mock", "--duration", "1", "--warmup", "600", "--clients", "2",
                     "--results-dir", str(tmp_path)])
    assert code == 2


def test_the_hostile_mix_reports_both_phases_and_their_ratio(tmp_path: Path) -> None:
    # The ratio's target is the real server's business (docs/performance.md); on a shared 2-core machine the
    # mock's figure is noise, so only the bookkeeping is judged here: both phases measured, the hostile
    # requests answered as the caps say, nothing left running.
    code = cli.main(["soak", "--mock", "--duration", "3", "--warmup", "1", "--phase-warmup", "1", "--clients", "4",
                     "--disconnect", "0", "--max-tokens", "4,16", "--hostile", "2", "--max-ratio", "1000",
                     "--max-rss-growth-mb", "1000", "--fanout-max-tokens", "8", "--flood-max-tokens", "64",
                     "--results-dir", str(tmp_path)])
    (run,) = tmp_path.iterdir()
    res = json.loads((run / "soak.json").read_text())
    assert code == 0, res
    mixed = res["hostile"]
    base, host = (mixed["phases"][p]["well_behaved"] for p in ("baseline", "hostile"))
    for wb in (base, host):
        assert wb["n"] > 0 and wb["itl_gaps"] > 0 and 0 < wb["itl_p50_s"] <= wb["itl_p99_s"]
        assert 0 < wb["ttft_p50_s"] <= wb["ttft_p99_s"]
    assert mixed["ratio"]["ttft_p99"] == host["ttft_p99_s"] / base["ttft_p99_s"]
    assert mixed["ratio"]["itl_p99"] == host["itl_p99_s"] / base["itl_p99_s"]
    statuses = mixed["hostile_requests"]["statuses"]
    for kind in ("oversized_chat", "oversized_messages", "oversized_responses"):
        assert set(statuses[kind]) == {"400"}, statuses  # refused by --max-prompt-bytes
    assert set(statuses["fanout"]) == {"200"} and set(statuses["flood"]) == {"200"}, statuses  # within the caps
    assert res["after"] == {**res["after"], "live_requests": 0, "running": 0, "waiting": 0, "kv_blocks_used": 0}
    assert res["5xx"] == 0 and not res["error_events"]


def test_a_hostile_soak_whose_phases_measured_no_itl_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One token per choice: TTFT but no inter-token gap in either phase; the run must not pass for a ratio.
    code = cli.main(["soak", "--mock", "--duration", "1", "--warmup", "0", "--phase-warmup", "0", "--clients", "2",
                     "--disconnect", "0", "--max-tokens", "1", "--hostile", "2", "--max-ratio", "1000",
                     "--max-rss-growth-mb", "1000", "--fanout-max-tokens", "4", "--flood-max-tokens", "8",
                     "--results-dir", str(tmp_path)])
    assert code == 2
    assert "phase measured no well-behaved stream's TTFT and ITL" in capsys.readouterr().err
