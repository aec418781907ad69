"""/metrics carries vLLM's metric names beside trillm's own, parsed by prometheus_client's own parser; the
Grafana dashboard in docs/ queries only names /metrics exposes and loads into Grafana's schema models."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import MockFactory, running_app
from trillm.web.service.metrics import VLLM_FAMILIES, VLLM_ITL_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS

DASHBOARD = pathlib.Path(__file__).resolve().parents[3] / "docs" / "grafana-dashboard.json"

# What vLLM's v1 PrometheusStatLogger declares (vllm/v1/metrics/loggers.py): family name as the parser reports
# it (counters without `_total`) -> type. Written out here, independently of web/metrics.py's table.
VLLM_EXPECTED = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
}
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
}
VLLM_BUCKETS["vllm:time_per_output_token_seconds"] = VLLM_BUCKETS["vllm:inter_token_latency_seconds"]
for _phase in ("queue", "prefill", "decode", "inference"):  # vLLM's request_latency_buckets, as for e2e
    VLLM_BUCKETS[f"vllm:request_{_phase}_time_seconds"] = VLLM_BUCKETS["vllm:e2e_request_latency_seconds"]


async def _scrape(client: Any) -> dict[str, Any]:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.content_type.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(await r.get_data(as_text=True))}


async def test_vllm_names_types_labels_and_buckets() -> None:
    async with running_app(MockFactory()) as client:
        await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
        await client.post("/v1/completions", json={"prompt": "abc def", "max_tokens": 3, "n": 2})
        families = await _scrape(client)
    for name, kind in VLLM_EXPECTED.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            assert sample.labels["model_name"] == "mock-model" and sample.labels["engine"] == "0", sample
    assert VLLM_FAMILIES == VLLM_EXPECTED
    for name, edges in VLLM_BUCKETS.items():
        les = [s.labels["le"] for s in families[name].samples if s.name == name + "_bucket"]
        assert les == [repr(float(e)) for e in edges] + ["+Inf"]
    assert list(VLLM_TTFT_BUCKETS) == VLLM_BUCKETS["vllm:time_to_first_token_seconds"]
    assert list(VLLM_ITL_BUCKETS) == VLLM_BUCKETS["vllm:inter_token_latency_seconds"]
    assert list(VLLM_REQUEST_LATENCY_BUCKETS) == VLLM_BUCKETS["vllm:e2e_request_latency_seconds"]

    def value(name: str, sample: str | None = None, **labels: str) -> float:
        return sum(s.value for s in families[name].samples
                   if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()))

    # Three generations, all by length (the mock ignores EOS until max_tokens): 4 + 3 + 3 tokens.
    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 0
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"].samples} == {
        "stop", "length", "abort", "error"}
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 10
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") > 0
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 3
    assert value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
    for phase in ("queue", "prefill", "decode", "inference"):
        name = f"vllm:request_{phase}_time_seconds"
        assert value(name, name + "_count") == 3
    # The phases add up: each request's queue + inference is its e2e latency (to within the clock's reads).
    e2e = value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    parts = value("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_sum") + value(
        "vllm:request_inference_time_seconds", "vllm:request_inference_time_seconds_sum")
    assert parts == pytest.approx(e2e, rel=0.05, abs=1e-3)
    assert value("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 3 + 2 + 2
    assert value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") >= value(
        "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert 0.0 <= value("vllm:kv_cache_usage_perc") <= 1.0
    # trillm's own names are still there, under their own label.
    assert families["trillm_requests"].type == "counter"
    assert value("trillm_requests", "trillm_requests_total", model="mock-model", outcome="length") == 3


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))
    return out


def _metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects, found by parsing it (promql-parser, Prometheus's grammar)."""
    import promql_parser

    names: set[str] = set()

    def walk(node: Any) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            names.add(node.name)
            return
        if kind == "MatrixSelector":
            walk(node.vector_selector)
            return
        for attr in ("expr", "lhs", "rhs", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for arg in getattr(node, "args", None) or ():
            walk(arg)

    # Grafana's variables are not PromQL: give them values before parsing.
    for var, val in (("$__rate_interval", "1m"), ("$__interval", "1m"), ("$model_name", "m")):
        expr = expr.replace(var, val)
    walk(promql_parser.parse(expr))
    return names


def _exposed_series(families: dict[str, Any]) -> set[str]:
    return {s.name for f in families.values() for s in f.samples}


async def test_dashboard_queries_only_what_metrics_exposes() -> None:
    dash = _dashboard()
    async with running_app(MockFactory()) as client:
        await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        families = await _scrape(client)
    exposed = _exposed_series(families)
    exprs = [t["expr"] for p in _panels(dash["panels"]) for t in p.get("targets", [])]
    assert len(exprs) >= 8
    used: set[str] = set()
    for expr in exprs:
        names = _metric_names(expr)
        assert names, expr
        assert all(n.startswith("vllm:") for n in names), expr  # so it works on vLLM too
        assert names <= exposed, (expr, names - exposed)
        used |= names
    for required in ("vllm:num_requests_running", "vllm:time_to_first_token_seconds_bucket",
                     "vllm:inter_token_latency_seconds_bucket", "vllm:kv_cache_usage_perc",
                     "vllm:request_success_total"):
        assert required in used
    # The model variable reads vLLM's label.
    templ = dash["templating"]["list"]
    assert any(v["name"] == "model_name" and "model_name" in v["query"]["query"] for v in templ)


def test_dashboard_matches_grafana_schema() -> None:
    """Load it into grafana-foundation-sdk's models (generated from Grafana's dashboard schema) and back: every
    key the file uses must survive, so none is misspelt or unknown to Grafana."""
    pytest.importorskip("grafana_foundation_sdk")
    from grafana_foundation_sdk.cog import runtime
    from grafana_foundation_sdk.models import dashboard, prometheus, stat, timeseries

    runtime.register_dataquery_variant(prometheus.variant_config())
    for panel in (timeseries, stat):
        runtime.register_panelcfg_variant(panel.variant_config())
    raw = _dashboard()
    model = dashboard.Dashboard.from_json(raw)
    back = json.loads(json.dumps(model.to_json(), default=lambda o: o.to_json()))

    def keys(node: Any, path: str = "") -> set[str]:
        if isinstance(node, dict):
            return {f"{path}.{k}" for k in node} | {x for k, v in node.items() for x in keys(v, f"{path}.{k}")}
        if isinstance(node, list):
            return {x for i, v in enumerate(node) for x in keys(v, f"{path}[{i}]")}
        return set()

    lost = keys(raw) - keys(back)
    assert not lost, sorted(lost)[:20]
    assert model.title and model.uid and model.panels
    for p in _panels(raw["panels"]):
        assert p["type"] in ("row", "timeseries", "stat"), p["type"]


async def test_queue_time_is_the_wait_for_a_slot() -> None:
    """One running slot, two requests at once: the second waits out the first's ~10 steps of 10 ms."""
    import trio

    from trillm.engine.config import EngineConfig

    one_slot = EngineConfig(num_kv_blocks=512, max_num_seqs=1, max_num_batched_tokens=64)
    async with running_app(MockFactory(config=one_slot, step_delay=0.01)) as client:
        async def one() -> None:
            await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 10, "ignore_eos": True})

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(one)
        families = await _scrape(client)
    samples = {s.name: s.value for s in families["vllm:request_queue_time_seconds"].samples
               if not s.name.endswith("_bucket")}
    assert samples["vllm:request_queue_time_seconds_count"] == 2
    assert samples["vllm:request_queue_time_seconds_sum"] >= 0.08
    decode = {s.name: s.value for s in families["vllm:request_decode_time_seconds"].samples}
    assert decode["vllm:request_decode_time_seconds_sum"] >= 2 * 9 * 0.01 * 0.8
