"""The web playground: `GET /` serves a single-page chat UI, `GET /stats` feeds its live server panel (and
load tests' leak checks: what is live right now, per model).

The page is three static files in web/static/ (HTML, JS, CSS; no build step, nothing fetched from elsewhere).
Quart serves that folder at /static/ because the app's root_path is this package; `/` adds a strict
Content-Security-Policy, so even markup smuggled into the page could neither run scripts nor load anything
from another origin. The page chats over /v1/ws and polls /stats, which is open like /health and /metrics
(the same numbers as /metrics, as JSON).
"""

from __future__ import annotations

from typing import Any

from quart import Response
from quart_trio import QuartTrio

from trillm.engine.outputs import EngineStatistics
from trillm.web.service.engine_service import EngineService
from trillm.web.service.registry import ModelRegistry

PAGE = "playground.html"
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def engine_stats_json(stats: EngineStatistics | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {
        "running": stats.num_running, "waiting": stats.num_waiting,
        "kv_blocks_used": stats.num_blocks_used, "kv_blocks_total": stats.num_blocks_total,
        "kv_blocks_cached": stats.num_blocks_cached,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "prefix_cache_hits": stats.prefix_cache_hits, "prefix_cache_queries": stats.prefix_cache_queries,
        "prompt_tokens_per_s": stats.prompt_tokens_per_s, "generation_tokens_per_s": stats.generation_tokens_per_s,
        "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
        "spec_acceptance_rate": stats.spec_acceptance_rate, "spec_tokens_per_verify": stats.spec_tokens_per_verify,
        "spec_draft_tokens": stats.spec_draft_tokens, "spec_accepted_tokens": stats.spec_accepted_tokens,
        "spec_verifies": stats.spec_verifies,
        "memory_rss_bytes": stats.memory_rss_bytes, "memory_peak_bytes": stats.memory_peak_bytes,
        "memory_limit_bytes": stats.memory_limit_bytes, "kv_pool_bytes": stats.kv_pool_bytes,
        "kv_pool_used_bytes": stats.kv_pool_used_bytes,
        "kv_disk_hit_tokens": stats.kv_disk_hit_tokens, "kv_disk_hit_blocks": stats.kv_disk_hit_blocks,
        "kv_disk_miss_blocks": stats.kv_disk_miss_blocks, "kv_disk_blocks": stats.kv_disk_blocks,
        "kv_disk_bytes": stats.kv_disk_bytes, "kv_disk_writes": stats.kv_disk_writes,
        "kv_disk_dropped_writes": stats.kv_disk_dropped_writes, "kv_disk_corrupt_blocks": stats.kv_disk_corrupt_blocks,
        "kv_disk_read_seconds": stats.kv_disk_read_seconds, "kv_disk_write_seconds": stats.kv_disk_write_seconds,
    }


def model_stats_json(service: EngineService) -> dict[str, Any]:
    """One model's state, what is live, finished requests by outcome, and its engine's latest statistics."""
    st = service.statistics()
    return {"model": service.model_name, "state": st.state.value, "healthy": service.healthy,
            "live_requests": st.num_live_requests, "restarts": st.num_restarts, "steps": st.num_steps,
            "epoch": st.epoch, "requests": dict(service.metrics.outcomes), "engine": engine_stats_json(st.engine)}


def register_playground(app: QuartTrio, registry: ModelRegistry) -> None:
    # Static files revalidate (ETag) on every load, so a browser never runs a stale page after an upgrade.
    app.config["SEND_FILE_MAX_AGE_DEFAULT"] = 0

    @app.get("/")
    async def playground() -> Response:
        response = await app.send_static_file(PAGE)
        response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-cache"
        return response

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {"models": [model_stats_json(s) for s in registry.services]}
