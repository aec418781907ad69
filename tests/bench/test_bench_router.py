"""`trillm bench router` fails loudly when a run measured nothing, and reports medians over its trials."""

from __future__ import annotations

from typing import Any

import pytest

from trillm.bench.harness.arrival import Arrival
from trillm.bench.router import NothingMeasured, check_measured, median_of
from trillm.bench.harness.client import Target
from trillm.bench.harness.metrics import RequestRecord, summarize
from trillm.bench.harness.run import RunResult


def run_of(records: list[RequestRecord]) -> RunResult:
    return RunResult(Target("kv", "http://x"), "multi-turn", Arrival("concurrency", 1), tuple(records),
                     summarize(records, 1.0))


def stats(decisions: int) -> dict[str, Any]:
    return {"overhead": {"decisions": decisions}}


def test_a_run_that_measured_nothing_fails() -> None:
    failed = RequestRecord("r0", 0.0, 0.1, error_kind="connection_refused", error="refused")
    with pytest.raises(NothingMeasured, match="no request completed"):
        check_measured(run_of([failed]), stats(1))
    no_usage = RequestRecord("r1", 0.0, 0.1, chunk_times=(0.05,))
    with pytest.raises(NothingMeasured, match="no usage"):
        check_measured(run_of([no_usage]), stats(1))
    ok = RequestRecord("r2", 0.0, 0.1, chunk_times=(0.05,), prompt_tokens=10, completion_tokens=1, cached_tokens=0)
    with pytest.raises(NothingMeasured, match="no decision"):
        check_measured(run_of([ok]), stats(0))
    check_measured(run_of([ok]), stats(1))


def test_figures_are_medians_over_trials() -> None:
    def trial(cached: int, ttft: float) -> dict[str, Any]:
        return {"completed": 4, "total": 4, "prompt_tokens": 100, "cached_tokens": cached,
                "prefix_hit_rate": cached / 100, "ttft_p50_ms": ttft, "ttft_p90_ms": 2 * ttft, "e2e_p50_ms": 1.0,
                "request_throughput": 1.0, "output_throughput": 1.0, "duration_s": 1.0, "errors": {},
                "decision_ms": {"p50": ttft / 10}, "tokenize_ms": {"p50": 0.1}, "routed": [1, 3]}

    m = median_of([trial(10, 5.0), trial(30, 9.0), trial(20, 1.0)])
    assert (m["cached_tokens"], m["ttft_p50_ms"], m["decision_ms"]["p50"]) == (20, 5.0, 0.5)
    assert len(m["trials"]) == 3
