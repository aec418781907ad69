"""The router's own numbers: what it forwarded where, retries, and how long its decisions take.

Prometheus text at GET /metrics, and the same as JSON (with the decision-time percentiles) at GET /stats.
Touched only on the trio thread.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from trillm.web.router.core import RouterStatistics
from trillm.web.service.metrics import Histogram, escape_label

DECISION_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on a sorted list."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class RouterMetrics:
    def __init__(self, window: int = 100_000) -> None:
        self.responses: Counter[tuple[str, str]] = Counter()  # (replica, status class or "broken")
        self.retries: Counter[str] = Counter()  # why a request moved to another replica
        self.unroutable = 0  # requests answered 503 because no replica could take them
        self.decision = Histogram(DECISION_BUCKETS)  # request body read -> upstream request sent
        self.tokenize = Histogram(DECISION_BUCKETS)
        self._recent_decisions: deque[float] = deque(maxlen=window)
        self._recent_tokenize: deque[float] = deque(maxlen=window)

    def on_decision(self, seconds: float, tokenize_s: float | None) -> None:
        self.decision.observe(seconds)
        self._recent_decisions.append(seconds)
        if tokenize_s is not None:
            self.tokenize.observe(tokenize_s)
            self._recent_tokenize.append(tokenize_s)

    def on_response(self, replica: str, status: int | None) -> None:
        self.responses[(replica, "broken" if status is None else f"{status // 100}xx")] += 1

    def on_retry(self, reason: str) -> None:
        self.retries[reason] += 1

    def reset_window(self) -> None:
        """Forget the recent decision times (a benchmark measures one run at a time)."""
        self._recent_decisions.clear()
        self._recent_tokenize.clear()

    def overhead_json(self) -> dict[str, Any]:
        d = sorted(self._recent_decisions)
        t = sorted(self._recent_tokenize)
        return {"decisions": len(d), "decision_ms": {f"p{q}": 1e3 * percentile(d, q) for q in (50, 90, 99)},
                "tokenized": len(t), "tokenize_ms": {f"p{q}": 1e3 * percentile(t, q) for q in (50, 90, 99)}}

    def render(self, stats: RouterStatistics) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")

        family("trillm_router_responses_total", "counter", "Forwarded responses by replica and status class.")
        for (replica, status), n in sorted(self.responses.items()):
            lines.append(f'trillm_router_responses_total{{replica="{escape_label(replica)}",status="{status}"}} {n}')
        family("trillm_router_retries_total", "counter", "Requests moved to another replica, by reason.")
        for reason, n in sorted(self.retries.items()):
            lines.append(f'trillm_router_retries_total{{reason="{escape_label(reason)}"}} {n}')
        family("trillm_router_unroutable_total", "counter", "Requests refused because no replica could take them.")
        lines.append(f"trillm_router_unroutable_total {self.unroutable}")
        family("trillm_router_decision_seconds", "histogram", "Request read to upstream request sent.")
        lines.extend(self.decision.render("trillm_router_decision_seconds", 'policy="' + stats.policy + '"'))
        family("trillm_router_tokenize_seconds", "histogram", "Computing a prompt's token ids for routing.")
        lines.extend(self.tokenize.render("trillm_router_tokenize_seconds", 'policy="' + stats.policy + '"'))
        family("trillm_router_prompt_blocks_total", "counter", "Prompt KV blocks of routed requests.")
        lines.append(f"trillm_router_prompt_blocks_total {stats.prompt_blocks}")
        family("trillm_router_predicted_cached_blocks_total", "counter",
               "Of those, blocks the router expected cached on the replica it chose.")
        lines.append(f"trillm_router_predicted_cached_blocks_total {stats.predicted_cached_blocks}")
        family("trillm_router_replica_healthy", "gauge", "1 while the replica is in the pool.")
        for r in stats.replicas:
            lines.append(f'trillm_router_replica_healthy{{replica="{escape_label(r.url)}"}} '
                         f'{int(r.health.state.value == "healthy")}')
        gauges = (("trillm_router_kv_index_blocks", "Blocks the router's index holds for the worker."),
                  ("trillm_router_inflight_requests", "Requests this router has in flight on the worker."),
                  ("trillm_router_worker_requests", "Running + waiting requests (reported or routed)."),
                  ("trillm_router_worker_active_blocks", "KV blocks in use (reported or routed)."),
                  ("trillm_router_index_resyncs_total", "Times the worker's KV index was cleared to resync."))
        for name, help_text in gauges:
            family(name, "counter" if name.endswith("_total") else "gauge", help_text)
            for r in stats.replicas:
                for w in r.workers:
                    labels = f'replica="{escape_label(r.url)}",model="{escape_label(w.key.model)}"'
                    value = {"trillm_router_kv_index_blocks": w.index.num_blocks,
                             "trillm_router_inflight_requests": w.num_inflight,
                             "trillm_router_worker_requests": w.load.requests,
                             "trillm_router_worker_active_blocks": w.load.active_blocks,
                             "trillm_router_index_resyncs_total": w.index.num_resyncs}[name]
                    lines.append(f"{name}{{{labels}}} {value}")
        return "\n".join(lines) + "\n"


def statistics_json(stats: RouterStatistics) -> dict[str, Any]:
    return {
        "policy": stats.policy, "routed": stats.num_routed, "unroutable": stats.num_unroutable,
        "prompt_blocks": stats.prompt_blocks, "predicted_cached_blocks": stats.predicted_cached_blocks,
        "replicas": [{
            "url": r.url, "health": r.health.state.value, "reason": r.health.reason,
            "failures": r.health.num_failures, "models": list(r.models), "routed": r.num_routed,
            "workers": [{
                "model": w.key.model, "synced": w.index.synced, "epoch": w.index.epoch,
                "index_blocks": w.index.num_blocks, "events": w.index.num_events, "resyncs": w.index.num_resyncs,
                "unknown_removals": w.index.num_unknown_removals,
                "block_size": w.spec.block_size if w.spec else None,
                "model_id": w.spec.model_id if w.spec else None,
                "inflight": w.num_inflight, "routed": w.num_routed,
                "requests": w.load.requests, "active_blocks": w.load.active_blocks,
                "reported": None if w.reported is None else {
                    "running": w.reported.num_running, "waiting": w.reported.num_waiting,
                    "blocks_used": w.reported.num_blocks_used, "blocks_total": w.reported.num_blocks_total},
            } for w in r.workers],
        } for r in stats.replicas],
    }
