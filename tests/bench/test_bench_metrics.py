"""The benchmark's metric arithmetic against hand-computed values from synthetic timestamps."""

from __future__ import annotations

import errno

import httpx
import pytest

from trillm.bench.harness.client import StreamError, classify_error
from trillm.bench.harness.metrics import SLO, RequestRecord, Stat, summarize


def rec(rid: str, chunks: tuple[float, ...], latency: float, *, completion: int | None = None,
        prompt: int | None = None, cached: int | None = None, error: str | None = None) -> RequestRecord:
    return RequestRecord(rid, 0.0, latency, chunks, prompt, completion, cached, error_kind=error)


def test_ttft_itl_tpot_from_chunk_times() -> None:
    r = rec("a", (0.1, 0.15, 0.3, 0.35), 0.4)
    assert r.ttft == pytest.approx(0.1)
    assert r.itl == pytest.approx([0.05, 0.15, 0.05])
    assert r.output_tokens == 4  # no usage: one token per text chunk
    assert r.tpot == pytest.approx((0.4 - 0.1) / 3)


def test_usage_overrides_delta_count() -> None:
    r = rec("a", (0.1, 0.15, 0.3, 0.35), 0.4, completion=7)
    assert r.output_tokens == 7
    assert r.tpot == pytest.approx(0.3 / 6)


def test_single_token_and_no_token_requests_have_no_tpot() -> None:
    assert rec("a", (0.2,), 0.2).tpot is None
    empty = rec("b", (), 0.3)
    assert empty.ttft is None and empty.tpot is None and empty.itl == []


def test_percentiles_interpolate_linearly_in_ms() -> None:
    s = Stat.of([0.001, 0.002, 0.003, 0.004])
    assert (s.mean, s.p50) == pytest.approx((2.5, 2.5))
    assert s.p90 == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert s.p99 == pytest.approx(3.97)
    assert Stat.of([]) == Stat(0.0, 0.0, 0.0, 0.0)
    assert Stat.of([0.5]).p99 == pytest.approx(500.0)


def test_summary_throughput_goodput_errors() -> None:
    records = [
        rec("a", (0.1, 0.2, 0.3), 0.3, completion=3, prompt=10, cached=4),  # TTFT 100, TPOT 100
        rec("b", (0.2, 0.25), 0.3, completion=2, prompt=20, cached=0),  # TTFT 200, TPOT 100
        rec("c", (), 0.01, error="connection_reset"),
        rec("d", (), 0.01, error="connection_refused"),
        rec("e", (), 0.01, error="connection_reset"),
    ]
    s = summarize(records, 2.0, SLO(ttft_ms=150.0, tpot_ms=120.0))
    assert (s.completed, s.failed) == (2, 3)
    assert s.errors == {"connection_refused": 1, "connection_reset": 2}
    assert (s.input_tokens, s.output_tokens, s.cached_tokens, s.usage_reported) == (30, 5, 4, 2)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(2.5)
    assert s.total_token_throughput == pytest.approx(17.5)
    assert s.goodput == pytest.approx(0.5)  # only "a" meets TTFT <= 150 ms
    assert s.ttft.mean == pytest.approx(150.0)
    assert s.tpot.mean == pytest.approx(100.0)
    assert s.itl.mean == pytest.approx((100 + 100 + 50) / 3)
    assert s.e2e.p50 == pytest.approx(300.0)
    assert summarize(records, 2.0).goodput is None


def test_goodput_tpot_slo_alone() -> None:
    records = [rec("a", (0.1, 0.2, 0.3), 0.3, completion=3), rec("b", (0.1, 0.5), 0.5, completion=2)]
    assert summarize(records, 1.0, SLO(tpot_ms=150.0)).goodput == pytest.approx(1.0)  # b's TPOT is 400 ms


def test_classify_errors_keeps_refused_and_reset_apart() -> None:
    group = ExceptionGroup("all attempts failed", [ConnectionRefusedError(errno.ECONNREFUSED, "refused")])
    wrapped = httpx.ConnectError("all attempts to connect failed")
    wrapped.__cause__ = OSError("all attempts")
    wrapped.__cause__.__cause__ = group
    assert classify_error(wrapped) == "connection_refused"
    reset = httpx.ReadError("read failed")
    reset.__cause__ = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    assert classify_error(reset) == "connection_reset"
    assert classify_error(httpx.RemoteProtocolError("Server disconnected without sending a response.")) == (
        "connection_closed"
    )
    assert classify_error(httpx.ReadTimeout("slow")) == "timeout"
    assert classify_error(StreamError("http_503", "busy")) == "http_503"


def test_peer_targets_ratios_and_verdicts() -> None:
    from trillm.bench.peers import check_targets, targets_markdown

    fast = summarize([rec("a", (0.1, 0.2, 0.3), 0.3, completion=30)], 1.0)  # 30 tok/s, TTFT 100 ms
    slow = summarize([rec("b", (0.4, 0.5), 0.5, completion=10)], 1.0)  # 10 tok/s, TTFT 400 ms
    checks = check_targets({
        ("high-concurrency", "trillm"): fast, ("high-concurrency", "mlx_lm.server"): slow,
        ("multi-turn", "trillm"): slow, ("multi-turn", "trillm-no-cache"): fast,
        ("high-concurrency", "llama.cpp"): slow, ("single-stream", "trillm"): slow,
        ("single-stream", "llama.cpp"): fast,
    })
    by = {(c.workload, c.metric): c for c in checks}
    hi_out = by[("high-concurrency", "output tok/s, trillm / mlx_lm.server")]
    assert hi_out.ratio == pytest.approx(3.0) and hi_out.passed is True
    hi_ttft = by[("high-concurrency", "TTFT p90 ms, trillm / mlx_lm.server")]
    assert hi_ttft.ratio == pytest.approx(0.25) and hi_ttft.passed is True
    assert by[("single-stream", "output tok/s, trillm / mlx_lm.server")].passed is None  # not run
    mt = by[("multi-turn", "TTFT mean ms, trillm-no-cache / trillm")]
    assert mt.ratio == pytest.approx(0.25) and mt.passed is False  # cache made TTFT worse here
    stretch = by[("single-stream", "output tok/s, trillm / llama.cpp")]
    assert stretch.ratio == pytest.approx(1 / 3) and stretch.passed is False
    reported = by[("high-concurrency", "output tok/s, trillm / llama.cpp")]
    assert reported.ratio == pytest.approx(3.0) and reported.passed is None  # a ratio, no verdict
    assert by[("long-prompt", "TTFT mean ms, llama.cpp / trillm")].ratio is None
    md = targets_markdown(checks)
    assert "| reported |" in md and "| not measured |" in md
    assert "Target missed: single-stream output tok/s, trillm / llama.cpp" in md
    assert "Target missed: multi-turn" in targets_markdown(checks)
