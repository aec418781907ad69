"""`bench serve` end to end against a stand-in OpenAI SSE + websocket server (tests/bench/bench_standin.py)."""

from __future__ import annotations

import dataclasses
import importlib

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from bench_standin import StandIn, serve
from trillm.bench import cli, serve_spec
from trillm.bench.harness.arrival import Arrival
from trillm.bench.harness.client import GenerationOptions, Target
from trillm.bench.harness.run import run_workload
from trillm.bench.serve import run_matrix
from trillm.bench.harness.workloads import code_edit, multi_turn, random_lengths


async def test_sse_and_ws_runs_time_every_token(nursery: trio.Nursery) -> None:
    standin = StandIn(ttft_s=0.03, itl_s=0.01)
    http_port, ws_port = await nursery.start(serve, standin)
    targets = [
        Target("sse", f"http://127.0.0.1:{http_port}"),
        Target("ws", f"http://127.0.0.1:{ws_port}", transport="ws"),
    ]
    wls = [random_lengths(6, 12, 5, seed=1), multi_turn(2, 3, 6, 6, 4, system_len=8)]
    runs = await run_matrix(targets, wls, [Arrival("concurrency", 3)], GenerationOptions(ignore_eos=True),
                            progress=False, warmup=0, log=False)
    assert [(r.target.name, r.workload) for r in runs] == [
        ("sse", "random"), ("ws", "random"), ("ws", "multi-turn"), ("sse", "multi-turn")]  # order alternates
    for run in runs:
        s = run.summary
        assert s.failed == 0 and s.completed == len(run.records) == 6
        assert s.usage_reported == 6
        for r in run.records:
            assert r.completion_tokens == len(r.chunk_times)
            assert r.ttft is not None and r.ttft >= 0.03
            # the stand-in sleeps 10 ms between tokens (a slow client may read two in one go, so not per gap)
            assert r.chunk_times[-1] >= 0.03 + 0.01 * (len(r.chunk_times) - 1) - 1e-3
            assert r.latency >= r.chunk_times[-1]
        assert 5.0 <= s.itl.mean < 200.0  # ms
        if run.workload == "multi-turn":
            assert s.cached_tokens > 0  # later turns resend earlier ones
            turns = {r.request_id: r for r in run.records}
            assert turns["conv0-turn1"].start >= turns["conv0-turn0"].start + turns["conv0-turn0"].latency
    sent = standin.bodies[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["ignore_eos"] is True and sent["temperature"] == 0.0
    assert any("messages" in b for b in standin.bodies)  # chat workloads go to /v1/chat/completions


async def test_burst_and_rate_arrivals_and_failures_are_counted(nursery: trio.Nursery) -> None:
    standin = StandIn(ttft_s=0.01, itl_s=0.002)
    http_port, _ = await nursery.start(serve, standin)
    ok = Target("ok", f"http://127.0.0.1:{http_port}")
    bad = [Target(k, f"http://127.0.0.1:{http_port}/fail/{k}") for k in ("reset", "500", "stream")]
    wl = random_lengths(5, 8, 3, range_ratio=0.0)  # 3 tokens: the stream fails at the second
    runs = await run_matrix([ok, *bad], [wl], [Arrival("burst"), Arrival("rate", None, 200.0, 0.5)],
                            GenerationOptions(), progress=False, warmup=0, log=False)
    by = {(r.target.name, r.arrival.mode): r.summary for r in runs}
    for mode in ("burst", "rate"):
        assert by[("ok", mode)].completed == 5
        assert by[("reset", mode)].errors == {"connection_reset": 5}
        assert by[("500", mode)].errors == {"http_500": 5}
        assert by[("stream", mode)].errors == {"server_error": 5}
        assert by[("stream", mode)].completed == 0


@pytest.fixture
def standin_thread() -> Iterator[tuple[int, int]]:
    """The stand-in on its own trio loop in a thread, for the synchronous CLI."""
    ready: list[tuple[int, int]] = []
    started, stop = threading.Event(), threading.Event()

    async def host() -> None:
        async with trio.open_nursery() as n:
            ready.append(await n.start(serve, StandIn(ttft_s=0.01, itl_s=0.002)))
            started.set()
            while not stop.is_set():
                await trio.sleep(0.02)
            n.cancel_scope.cancel()

    t = threading.Thread(target=trio.run, args=(host,), daemon=True)
    t.start()
    assert started.wait(10)
    yield ready[0]
    stop.set()
    t.join(10)


def test_cli_writes_json_markdown_plots_and_meta(standin_thread: tuple[int, int], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    http_port, _ = standin_thread
    rc = cli.main([
        "serve", "--url", f"http://127.0.0.1:{http_port}", "--url", "http://127.0.0.1:1", "--name", "standin",
        "--name", "nobody", "--workload", "random", "--workload", "shared-prefix", "--num-prompts", "4",
        "--input-len", "16", "--output-len", "4", "--system-len", "20", "--concurrency", "1", "2",
        "--slo-ttft-ms", "1000", "--results-dir", str(tmp_path), "--no-progress", "--warmup", "0",
    ])
    assert rc == 0
    (out,) = list(tmp_path.iterdir())
    names = {p.name for p in out.iterdir()}
    assert {"meta.json", "serve.json", "serve.md", "serve_throughput_vs_concurrency.png", "serve_ttft_cdf.png"} <= names
    doc = json.loads((out / "serve.json").read_text())
    assert len(doc["runs"]) == 2 * 2 * 2  # servers x workloads x concurrencies
    for run in doc["runs"]:
        s = run["summary"]
        if run["server"] == "standin":
            assert s["completed"] == 4 and s["goodput"] == pytest.approx(s["request_throughput"])
            assert len(run["records"]) == 4 and run["records"][0]["ttft"] > 0
        else:  # nothing listens on port 1: every request is a counted error, none dropped
            assert s["errors"] == {"connection_refused": 4} and len(run["records"]) == 4
    meta = json.loads((out / "meta.json").read_text())
    assert meta["flags"]["concurrency"] == [1, 2] and meta["machine"]["packages"]["httpx"]
    table = capsys.readouterr().out
    assert "| standin | shared-prefix | c2 | 4/4 |" in table and "connection_refused=4" in table


def test_cli_reports_unknown_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["nope"]) == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err
    assert cli.main([]) == 2 and cli.main(["--help"]) == 0
    for name, (module, _) in cli.SUBCOMMANDS.items():  # every listed subcommand exists and has main(argv)
        assert callable(importlib.import_module(module).main), name


async def test_keep_text_records_what_was_generated(nursery: trio.Nursery) -> None:
    http_port, ws_port = await nursery.start(serve, StandIn(ttft_s=0.0, itl_s=0.0))
    wl = code_edit(2, 3)
    for target in (Target("sse", f"http://127.0.0.1:{http_port}"), Target("ws", f"http://127.0.0.1:{ws_port}",
                                                                             transport="ws")):
        kept = await run_workload(target, wl, Arrival("concurrency", 1), GenerationOptions(keep_text=True),
                                  progress=False)
        assert [r.text for r in kept.records] == [" w0 w1 w2"] * 2
        plain = await run_workload(target, wl, Arrival("concurrency", 1), GenerationOptions(), progress=False)
        assert all(r.text is None for r in plain.records)


async def test_serve_spec_compares_two_servers(nursery: trio.Nursery) -> None:
    ports = [(await nursery.start(serve, StandIn(ttft_s=0.0, itl_s=0.001)))[0] for _ in range(2)]
    args = serve_spec.build_parser().parse_args(
        ["--code-prompts", "2", "--code-tokens", "5", "--chat-prompts", "2", "--chat-tokens", "4",
         "--high-prompts", "4", "--high-concurrency", "4", "--trials", "2"])
    cases = serve_spec.plan(args)
    assert [(c.name, c.arrival.max_concurrency, len(c.workload.requests)) for c in cases] == [
        ("code-edit", 1, 2), ("chat", 1, 2), ("chat-c16", 4, 4)]
    targets = {serve_spec.OFF: Target("off", f"http://127.0.0.1:{ports[0]}"),
               serve_spec.ON: Target("on", f"http://127.0.0.1:{ports[1]}")}
    results, runs = await serve_spec.run_cases(targets, cases, GenerationOptions(keep_text=True), 2, 1, False)
    assert len(runs) == 3 * 2 * 2  # cases x trials x servers
    for r in results:
        assert r.identical and r.off.completed == r.on.completed == r.num_requests
        assert r.spec == serve_spec.SpecCounts()  # the stand-in has no /stats counters
    assert "| code-edit | 1 | 2 |" in serve_spec.markdown(results)
    # a text that differs, or a request that failed on one side, is reported by id
    a = runs[0]
    changed = dataclasses.replace(a.records[1], text="other")
    b = dataclasses.replace(a, records=(a.records[0], changed))
    assert serve_spec.differing_texts(a, b) == [a.records[1].request_id]
    assert serve_spec.differing_texts(a, dataclasses.replace(a, records=a.records[:1])) == [a.records[1].request_id]


def test_spec_counts_read_the_stats_page() -> None:
    engine = {"spec_draft_tokens": 80, "spec_accepted_tokens": 50, "spec_verifies": 10}
    now = serve_spec.SpecCounts.of_stats({"models": [{"engine": engine}, {"engine": None}]})
    delta = now - serve_spec.SpecCounts(40, 20, 5)
    assert delta == serve_spec.SpecCounts(40, 30, 5)
    assert delta.acceptance_rate == 0.75 and delta.tokens_per_forward == 7.0
    assert serve_spec.SpecCounts().tokens_per_forward == 1.0
