"""Prometheus text exposition for the service: request outcomes, latency histograms, tokens, engine gauges.

Everything here is touched only on the trio thread, so there are no locks.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping

from trillm.engine.outputs import EngineStatistics, RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


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


class ModelMetrics:
    """The counters and histograms of one served model."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()  # stop, length, abort, error, rejected
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.inter_token = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0

    def on_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def on_finished(self, output: RequestOutput) -> None:
        assert output.finish_reason is not None
        self.on_outcome(output.finish_reason.value)
        self.prompt_tokens += output.usage.prompt_tokens
        self.generation_tokens += output.usage.completion_tokens
        self.cached_tokens += output.usage.cached_tokens


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
        for outcome in ("stop", "length", "abort", "error", "rejected"):
            lines.append(f'trillm_requests_total{{model="{_escape(model)}",outcome="{outcome}"}} {m.outcomes[outcome]}')
    for name, attr, help_text in (
        ("trillm_time_to_first_token_seconds", "ttft", "Time from submission to the first token."),
        ("trillm_inter_token_latency_seconds", "inter_token", "Time between tokens of one request."),
        ("trillm_e2e_request_latency_seconds", "e2e", "Time from submission to the last token."),
    ):
        family(name, "histogram", help_text)
        for model, (m, _, _) in models.items():
            lines.extend(getattr(m, attr).render(name, f'model="{_escape(model)}"'))
    for name, attr, help_text in (
        ("trillm_prompt_tokens_total", "prompt_tokens", "Prompt tokens of finished requests."),
        ("trillm_generation_tokens_total", "generation_tokens", "Generated tokens of finished requests."),
        ("trillm_cached_prompt_tokens_total", "cached_tokens", "Prompt tokens served from the prefix cache."),
    ):
        family(name, "counter", help_text)
        for model, (m, _, _) in models.items():
            lines.append(f'{name}{{model="{_escape(model)}"}} {getattr(m, attr)}')
    gauges: tuple[tuple[str, str, str], ...] = (
        ("trillm_num_requests_running", "num_running", "Requests being decoded or prefilled."),
        ("trillm_num_requests_waiting", "num_waiting", "Requests in the engine's waiting queue."),
        ("trillm_kv_blocks_used", "num_blocks_used", "KV cache blocks in use."),
        ("trillm_kv_blocks_total", "num_blocks_total", "KV cache blocks in the pool."),
        ("trillm_prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache."),
        ("trillm_num_preemptions", "num_preemptions", "Preemptions so far."),
    )
    for name, attr, help_text in gauges:
        family(name, "gauge", help_text)
        for model, (_, stats, _) in models.items():
            if stats is not None:
                lines.append(f'{name}{{model="{_escape(model)}"}} {float(getattr(stats, attr))}')
    family("trillm_model_healthy", "gauge", "1 when the model's engine is loaded and healthy.")
    for model, (_, _, healthy) in models.items():
        lines.append(f'trillm_model_healthy{{model="{_escape(model)}"}} {int(healthy)}')
    return "\n".join(lines) + "\n"


def render_kernel_metrics(models: Mapping[str, Mapping[str, str]]) -> str:
    """Which implementation each kernel op runs, per model: op -> "metal" / "cuda" / "cpu" / "reference"."""
    lines = ["# HELP trillm_kernel_implementation 1 for the implementation each kernel op runs (start-up self-check).",
             "# TYPE trillm_kernel_implementation gauge"]  # fmt: skip
    for model, ops in models.items():
        for op, impl in ops.items():
            lines.append(f'trillm_kernel_implementation{{model="{_escape(model)}",op="{_escape(op)}",'
                         f'implementation="{_escape(impl)}"}} 1')  # fmt: skip
    return "\n".join(lines) + "\n"
