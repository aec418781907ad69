"""`bench serve` and `bench peers` against live servers on the tiny random model (tests/conftest.py).

Each test starts real server processes (a few seconds each on 2 cores): trillm via `python -m trillm.web.cli
serve`, and mlx_lm.server.
"""

from __future__ import annotations

import json
from pathlib import Path

from trillm.bench import cli
from trillm.bench.harness.servers import ServerProcess, free_port, trillm_command


def test_bench_serve_against_live_trillm_sse_and_ws(tiny_model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    with ServerProcess("trillm", trillm_command(str(tiny_model_path), port), port, tmp_path / "trillm.log") as sp:
        sp.wait_ready(120)
        for transport in ("sse", "ws"):
            rc = cli.main([
                "serve", "--url", sp.url, "--name", f"trillm-{transport}", "--transport", transport,
                "--workload", "random", "--workload", "multi-turn", "--num-prompts", "6", "--num-turns", "3",
                "--input-len", "24", "--output-len", "6", "--system-len", "48", "--concurrency", "3",
                "--ignore-eos", "--results-dir", str(tmp_path / transport), "--no-progress",
            ])
            assert rc == 0
            (out,) = list((tmp_path / transport).iterdir())
            runs = json.loads((out / "serve.json").read_text())["runs"]
            assert [r["workload"] for r in runs] == ["random", "multi-turn"]
            for run in runs:
                s = run["summary"]
                assert (s["completed"], s["failed"]) == (6, 0), s["errors"]
                assert s["usage_reported"] == 6  # token counts come from the server's usage
                assert all(r["completion_tokens"] == r["output_tokens"] > 0 for r in run["records"])
                assert s["ttft"]["p50"] > 0 and s["output_throughput"] > 0
            assert runs[1]["summary"]["cached_tokens"] > 0  # later turns hit trillm's prefix cache


def test_bench_peers_runs_both_servers_and_checks_targets(tiny_model_path: Path, tmp_path: Path) -> None:
    rc = cli.main([
        "peers", "--model", str(tiny_model_path), "--high-concurrency", "4", "--high-prompts", "4",
        "--single-prompts", "2", "--input-len", "16", "--output-len", "4", "--conversations", "2", "--turns", "2",
        "--system-len", "32", "--turn-len", "8", "--turn-output-len", "4", "--prefill-prompts", "1",
        "--prefill-len", "32", "--warmup", "1", "--results-dir", str(tmp_path), "--no-progress",
        "--startup-timeout", "180",
    ])
    assert rc == 0
    (out,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    doc = json.loads((out / "peers.json").read_text())
    servers = {(r["workload"], r["server"]) for r in doc["runs"]}
    assert ("random", "mlx_lm.server") in servers and ("multi-turn", "trillm-no-cache") in servers
    for run in doc["runs"]:
        assert run["summary"]["failed"] == 0, (run["server"], run["summary"]["errors"])
    targets = json.loads((out / "targets.json").read_text())
    ours = [t for t in targets if "llama.cpp" not in t["metric"] and t["target"] != "report"]
    assert len(ours) == 4 and all(t["passed"] is not None for t in ours)
    # --model without --llama-cpp-gguf: llama.cpp is skipped (said once), its rows are not measured
    assert all(t["ratio"] is None for t in targets if "llama.cpp" in t["metric"])
    prefill = [t for t in targets if t["workload"] == "long-prompt" and "mlx_lm.server" in t["metric"]]
    assert prefill and prefill[0]["ratio"] is not None and prefill[0]["passed"] is None
    assert "## Targets" in (out / "peers.md").read_text()
