"""`trillm bench soak` end to end on a short run against `trillm serve --mock`; it fails when it measured nothing."""

from __future__ import annotations

import json
from pathlib import Path

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
