"""Prometheus text exposition for the service: request outcomes, latency histograms, tokens, engine gauges.

Two sets of names for the same measurements: trillm's own (`trillm_*`, label `model`) and vLLM's (`vllm:*`,
labels `model_name` and `engine`), so dashboards and autoscalers built for vLLM work unchanged. The vLLM
names, types, labels and bucket edges follow vLLM's v1 PrometheusStatLogger (vllm-project/vllm,
vllm/v1/metrics/loggers.py, the 0.11/0.12 releases, checked against its metrics design doc
docs/design/metrics.md): counters are declared without `_total` there and exposed with it by
prometheus_client, which is what is written here. vLLM hides the deprecated
vllm:time_per_output_token_seconds since 0.12 (it observes exactly what vllm:inter_token_latency_seconds
does); it is kept here because older dashboards still read it.

The exposition is hand-written rather than prometheus_client's registry: every number is already kept here
(or in the engine's cumulative statistics, read once per scrape) on the trio thread, so a registry would
only add a second copy of each; tests parse the output with prometheus_client's own parser.

Everything here is touched only on the trio thread, so there are no locks.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping

from trillm.engine.outputs import EngineStatistics, RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

# vLLM's bucket edges (loggers.py): time to first token; inter-token latency and time per output token share
# theirs; every per-request duration (e2e, queue, prefill, decode) uses request_latency_buckets.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's FinishReason strings (stop, length, abort; "error" since 0.11). trillm's own outcomes map onto them:
# a grammar that completes is a stop, a request past its deadline was aborted by the server.
VLLM_FINISHED_REASONS = ("stop", "length", "abort", "error")
_TO_VLLM_REASON = {"stop": "stop", "grammar": "stop", "length": "length", "abort": "abort", "timeout": "abort",
                   "error": "error"}
OUTCOMES = ("stop", "length", "abort", "timeout", "error", "rejected")
# The family names /metrics exposes for vLLM (what docs/grafana-dashboard.json may query).
VLLM_FAMILIES: dict[str, str] = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
}


class Histogram:
    """A cumulative Prometheus histogram with fixed buckets."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, labels: str) -> Iterable[str]:
        cumulative = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            yield f'{name}_bucket{{{labels},le="{le}"}} {cumulative}'
        yield f"{name}_sum{{{labels}}} {self.sum}"
        yield f"{name}_count{{{labels}}} {self.count}"


class Histograms:
    """One measurement kept twice: with trillm's buckets and with vLLM's (`observe` feeds both)."""

    def __init__(self, buckets: tuple[float, ...], vllm_buckets: tuple[float, ...]) -> None:
        self.own = Histogram(buckets)
        self.vllm = Histogram(vllm_buckets)

    @property
    def count(self) -> int:
        return self.own.count

    def observe(self, value: float) -> None:
        self.own.observe(value)
        self.vllm.observe(value)


class ModelMetrics:
    """The counters and histograms of one served model."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()  # OUTCOMES, and grammar (a finish reason of its own)
        self.ttft = Histograms(LATENCY_BUCKETS, VLLM_TTFT_BUCKETS)
        self.inter_token = Histograms(LATENCY_BUCKETS, VLLM_ITL_BUCKETS)
        self.e2e = Histograms(E2E_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = 0  # of finished requests
        self.generation_tokens = 0
        self.cached_tokens = 0
        # As vLLM counts them: a request's prompt once its first token is out, each token as it is generated.
        self.live_prompt_tokens = 0
        self.live_generation_tokens = 0
        # A finished request's phases, as vLLM splits them: waiting, prefill (to the first token), decode
        # (first to last token); inference is prefill + decode.
        self.queue_time = Histogram(VLLM_REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(VLLM_REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(VLLM_REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(VLLM_REQUEST_LATENCY_BUCKETS)

    def on_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def on_delta(self, output: RequestOutput, *, first: bool) -> None:
        """One delta reached its handle; `first`: its request's first tokens."""
        if first:
            self.live_prompt_tokens += output.usage.prompt_tokens
        self.live_generation_tokens += len(output.new_token_ids)

    def on_phases(self, *, queue: float, prefill: float, decode: float) -> None:
        self.queue_time.observe(max(0.0, queue))
        self.prefill_time.observe(max(0.0, prefill))
        self.decode_time.observe(max(0.0, decode))
        self.inference_time.observe(max(0.0, prefill) + max(0.0, decode))

    def on_finished(self, output: RequestOutput) -> None:
        assert output.finish_reason is not None
        self.on_outcome(output.finish_reason.value)
        self.prompt_tokens += output.usage.prompt_tokens
        self.generation_tokens += output.usage.completion_tokens
        self.cached_tokens += output.usage.cached_tokens


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _vllm_labels(model: str) -> str:
    return f'model_name="{escape_label(model)}",engine="0"'  # one engine per served model


def render_metrics(
    models: Mapping[str, tuple[ModelMetrics, EngineStatistics | None, bool]],
) -> str:
    """The Prometheus text for every model: name -> (metrics, latest engine statistics, healthy)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    family("trillm_requests_total", "counter", "Finished requests by outcome.")
    for model, (m, _, _) in models.items():
        for outcome in OUTCOMES:
            lines.append(f'trillm_requests_total{{model="{escape_label(model)}",outcome="{outcome}"}} '
                         f'{m.outcomes[outcome]}')
    for name, attr, help_text in (
        ("trillm_time_to_first_token_seconds", "ttft", "Time from submission to the first token."),
        ("trillm_inter_token_latency_seconds", "inter_token", "Time between tokens of one request."),
        ("trillm_e2e_request_latency_seconds", "e2e", "Time from submission to the last token."),
    ):
        family(name, "histogram", help_text)
        for model, (m, _, _) in models.items():
            lines.extend(getattr(m, attr).own.render(name, f'model="{escape_label(model)}"'))
    for name, attr, help_text in (
        ("trillm_prompt_tokens_total", "prompt_tokens", "Prompt tokens of finished requests."),
        ("trillm_generation_tokens_total", "generation_tokens", "Generated tokens of finished requests."),
        ("trillm_cached_prompt_tokens_total", "cached_tokens", "Prompt tokens served from the prefix cache."),
    ):
        family(name, "counter", help_text)
        for model, (m, _, _) in models.items():
            lines.append(f'{name}{{model="{escape_label(model)}"}} {getattr(m, attr)}')
    gauges: tuple[tuple[str, str, str], ...] = (
        ("trillm_num_requests_running", "num_running", "Requests being decoded or prefilled."),
        ("trillm_num_requests_waiting", "num_waiting", "Requests in the engine's waiting queue."),
        ("trillm_kv_blocks_used", "num_blocks_used", "KV cache blocks in use."),
        ("trillm_kv_blocks_total", "num_blocks_total", "KV cache blocks in the pool."),
        ("trillm_prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache."),
        ("trillm_num_preemptions", "num_preemptions", "Preemptions so far."),
        ("trillm_spec_draft_tokens", "spec_draft_tokens", "Speculative decoding: proposed tokens verified so far."),
        ("trillm_spec_accepted_tokens", "spec_accepted_tokens", "Speculative decoding: of those, accepted."),
        ("trillm_spec_verifies", "spec_verifies", "Speculative decoding: row-steps that verified proposals so far."),
        ("trillm_spec_acceptance_rate", "spec_acceptance_rate", "Speculative decoding: accepted / proposed tokens."),
        ("trillm_spec_tokens_per_verify", "spec_tokens_per_verify",
         "Speculative decoding: tokens a speculating row got per forward (1: none)."),
        ("trillm_memory_rss_bytes", "memory_rss_bytes", "Resident memory of the process."),
        ("trillm_memory_peak_bytes", "memory_peak_bytes", "Peak resident memory of the process."),
        ("trillm_memory_limit_bytes", "memory_limit_bytes", "The process's memory limit (--memory-limit; 0: none)."),
        ("trillm_kv_pool_bytes", "kv_pool_bytes", "Memory the KV pool has allocated (it grows and shrinks)."),
        ("trillm_kv_pool_used_bytes", "kv_pool_used_bytes", "Of it, blocks held by requests."),
    )
    for name, attr, help_text in gauges:
        family(name, "gauge", help_text)
        for model, (_, stats, _) in models.items():
            if stats is not None:
                lines.append(f'{name}{{model="{escape_label(model)}"}} {float(getattr(stats, attr))}')
    # The prefix cache's disk tier (--kv-cache-dir; all 0 without one): what it holds, and its counters.
    disk: tuple[tuple[str, str, str, str], ...] = (
        ("trillm_kv_disk_blocks", "gauge", "kv_disk_blocks", "Disk tier: KV blocks in the folder."),
        ("trillm_kv_disk_bytes", "gauge", "kv_disk_bytes", "Disk tier: bytes of the KV block files."),
        ("trillm_kv_disk_hit_blocks_total", "counter", "kv_disk_hit_blocks",
         "Disk tier: blocks past the memory hits that admission loaded from disk."),
        ("trillm_kv_disk_miss_blocks_total", "counter", "kv_disk_miss_blocks",
         "Disk tier: blocks past the memory hits that admission looked up and did not load (computed)."),
        ("trillm_kv_disk_writes_total", "counter", "kv_disk_writes", "Disk tier: blocks written."),
        ("trillm_kv_disk_dropped_writes_total", "counter", "kv_disk_dropped_writes",
         "Disk tier: evicted blocks not written because the write queue was full."),
        ("trillm_kv_disk_load_failures_total", "counter", "kv_disk_corrupt_blocks",
         "Disk tier: block files that failed their check on load (deleted; the block is computed)."),
        ("trillm_kv_disk_read_seconds_total", "counter", "kv_disk_read_seconds",
         "Disk tier: seconds spent reading and checking block files."),
        ("trillm_kv_disk_write_seconds_total", "counter", "kv_disk_write_seconds",
         "Disk tier: seconds spent writing block files."),
    )
    for name, kind, attr, help_text in disk:
        family(name, kind, help_text)
        for model, (_, stats, _) in models.items():
            if stats is not None:
                lines.append(f'{name}{{model="{escape_label(model)}"}} {float(getattr(stats, attr))}')
    family("trillm_model_healthy", "gauge", "1 when the model's engine is loaded and healthy.")
    for model, (_, _, healthy) in models.items():
        lines.append(f'trillm_model_healthy{{model="{escape_label(model)}"}} {int(healthy)}')
    lines.extend(_render_vllm(models))
    return "\n".join(lines) + "\n"


def _render_vllm(models: Mapping[str, tuple[ModelMetrics, EngineStatistics | None, bool]]) -> Iterable[str]:
    """vLLM's names for the same numbers (see the module docstring for the source they were checked against)."""

    def family(name: str, help_text: str) -> Iterable[str]:
        kind = VLLM_FAMILIES[name]
        exposed = name + "_total" if kind == "counter" else name
        yield f"# HELP {exposed} {help_text}"
        yield f"# TYPE {exposed} {kind}"

    # Engine state: only while an engine is up (a dead engine's numbers must not live on).
    engine_values: tuple[tuple[str, str, str], ...] = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         "prefix_cache_queries"),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    )
    for name, help_text, attr in engine_values:
        yield from family(name, help_text)
        suffix = "_total" if VLLM_FAMILIES[name] == "counter" else ""
        for model, (_, stats, _) in models.items():
            if stats is None:
                continue
            value = (stats.num_blocks_used / stats.num_blocks_total if stats.num_blocks_total else 0.0
                     ) if attr == "kv_usage" else getattr(stats, attr)
            yield f"{name}{suffix}{{{_vllm_labels(model)}}} {float(value)}"
    for name, help_text, attr in (
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", "live_prompt_tokens"),
        ("vllm:generation_tokens", "Number of generation tokens processed.", "live_generation_tokens"),
    ):
        yield from family(name, help_text)
        for model, (m, _, _) in models.items():
            yield f"{name}_total{{{_vllm_labels(model)}}} {float(getattr(m, attr))}"
    yield from family("vllm:request_success", "Count of successfully processed requests.")
    for model, (m, _, _) in models.items():
        by_reason: Counter[str] = Counter()
        for outcome, reason in _TO_VLLM_REASON.items():
            by_reason[reason] += m.outcomes[outcome]
        for reason in VLLM_FINISHED_REASONS:
            yield (f'vllm:request_success_total{{{_vllm_labels(model)},finished_reason="{reason}"}} '
                   f"{float(by_reason[reason])}")
    for name, help_text, attr in (
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue_time"),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
         "prefill_time"),
        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "decode_time"),
        ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
         "inference_time"),
    ):
        yield from family(name, help_text)
        for model, (m, _, _) in models.items():
            yield from getattr(m, attr).render(name, _vllm_labels(model))
    for name, help_text, attr in (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "inter_token"),
        ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. DEPRECATED: "
                                               "Use vllm:inter_token_latency_seconds instead.", "inter_token"),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
    ):
        yield from family(name, help_text)
        for model, (m, _, _) in models.items():
            yield from getattr(m, attr).vllm.render(name, _vllm_labels(model))


def render_key_metrics(keys: Mapping[str, Mapping[str, int]]) -> str:
    """Per API key name (--api-key-file; never the key): requests by outcome, and requests in flight."""
    lines = ["# HELP trillm_api_key_requests_total Requests per API key name: admitted, or refused by a limit.",
             "# TYPE trillm_api_key_requests_total counter"]
    for name, s in keys.items():
        for outcome in ("admitted", "rate_limited", "concurrency_limited"):
            lines.append(f'trillm_api_key_requests_total{{key_name="{escape_label(name)}",outcome="{outcome}"}} '
                         f'{s[outcome]}')
    lines += ["# HELP trillm_api_key_requests_in_flight Requests of each API key name being served now.",
              "# TYPE trillm_api_key_requests_in_flight gauge"]
    for name, s in keys.items():
        lines.append(f'trillm_api_key_requests_in_flight{{key_name="{escape_label(name)}"}} {s["in_flight"]}')
    return "\n".join(lines) + "\n"


def render_kernel_metrics(models: Mapping[str, Mapping[str, str]]) -> str:
    """Which implementation each kernel op runs, per model: op -> "metal" / "cuda" / "cpu" / "reference"."""
    lines = ["# HELP trillm_kernel_implementation 1 for the implementation each kernel op runs (start-up self-check).",
             "# TYPE trillm_kernel_implementation gauge"]  # fmt: skip
    for model, ops in models.items():
        for op, impl in ops.items():
            lines.append(f'trillm_kernel_implementation{{model="{escape_label(model)}",op="{escape_label(op)}",'
                         f'implementation="{escape_label(impl)}"}} 1')  # fmt: skip
    return "\n".join(lines) + "\n"
