"""Drive one workload against one server under one arrival setting, with a progress bar."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import httpx
import trio
from tqdm import tqdm

from trillm.bench.harness.arrival import Arrival, start_offsets
from trillm.bench.harness.client import GenerationOptions, Target, send_sse, send_ws
from trillm.bench.harness.metrics import SLO, RequestRecord, Summary, summarize
from trillm.bench.harness.workloads import BenchRequest, Workload


@dataclass(frozen=True, slots=True)
class RunResult:
    """Raw records and the summary of one run."""

    target: Target
    workload: str
    arrival: Arrival
    records: tuple[RequestRecord, ...]
    summary: Summary

    def to_json(self) -> dict[str, object]:
        return {
            "server": self.target.name,
            "url": self.target.url,
            "transport": self.target.transport,
            "workload": self.workload,
            "arrival": {
                "mode": self.arrival.mode,
                "label": self.arrival.label,
                "max_concurrency": self.arrival.max_concurrency,
                "request_rate": None if math.isinf(self.arrival.request_rate) else self.arrival.request_rate,
                "burstiness": self.arrival.burstiness,
            },
            "summary": self.summary.to_json(),
            "records": [r.to_json() for r in self.records],
        }


def _limits(arrival: Arrival, num_units: int) -> httpx.Limits:
    # A burst opens one connection per request at once; otherwise keep-alive connections are reused.
    if arrival.mode == "burst":
        return httpx.Limits(max_connections=None, max_keepalive_connections=0)
    cap = arrival.max_concurrency or num_units
    return httpx.Limits(max_connections=None, max_keepalive_connections=max(1, cap))


async def run_workload(
    target: Target,
    workload: Workload,
    arrival: Arrival,
    opts: GenerationOptions,
    *,
    slo: SLO | None = None,
    seed: int = 0,
    progress: bool = True,
) -> RunResult:
    """Send every request of workload to target; a session's turns go one after another."""
    units = workload.sessions()
    offsets = (
        start_offsets(len(units), arrival.request_rate, arrival.burstiness, seed)
        if arrival.mode == "rate"
        else [0.0] * len(units)
    )
    limit = arrival.max_concurrency if arrival.mode != "burst" else None
    limiter = trio.CapacityLimiter(limit) if limit else None
    records: list[RequestRecord] = []
    trio_t0 = 0.0
    bar = tqdm(
        total=len(workload.requests), desc=f"{target.name} {workload.name} {arrival.label}",
        disable=not progress, leave=False, unit="req",
    )

    async def one(client: httpx.AsyncClient, req: BenchRequest, run_t0: float) -> RequestRecord:
        if target.transport == "ws":
            return await send_ws(target, req, opts, run_t0)
        return await send_sse(client, target, req, opts, run_t0)

    async def session(client: httpx.AsyncClient, unit: list[BenchRequest], at: float, run_t0: float) -> None:
        await trio.sleep_until(trio_t0 + at)
        if limiter is not None:
            await limiter.acquire_on_behalf_of(unit[0].request_id)
        try:
            for req in unit:
                rec = await one(client, req, run_t0)
                records.append(rec)
                bar.update(1)
                if not rec.success:
                    break  # later turns would resend a history the server never answered
        finally:
            if limiter is not None:
                limiter.release_on_behalf_of(unit[0].request_id)

    timeout = httpx.Timeout(opts.timeout_s, connect=30.0)
    try:
        async with httpx.AsyncClient(timeout=timeout, limits=_limits(arrival, len(units))) as client:
            # trio's clock has its own offset; records are timed with perf_counter.
            trio_t0, t0 = trio.current_time(), time.perf_counter()
            async with trio.open_nursery() as nursery:
                for unit, at in zip(units, offsets):
                    nursery.start_soon(session, client, unit, at, t0)
            duration = time.perf_counter() - t0
    finally:
        bar.close()
    records.sort(key=lambda r: r.start)
    return RunResult(target, workload.name, arrival, tuple(records), summarize(records, duration, slo))
