"""Fairness in TTFT terms, through the HTTP server: a short request's time to first token while one
/v1/completions request fans out to the cap stays under twice its TTFT on an idle server.

A live hypercorn server on loopback, the mock engine inline (its steps in a trio task) and trio's MockClock:
every engine step costs STEP_S of virtual time, whatever it holds, and nothing else takes any, so the
figures count steps and no machine's load changes them. Idle, a request's first token comes one step after
it arrives. Beside a running batch it waits for the step in progress to end (part of a step) and is in the
next one, so under 2 steps, if fairness gives it a row at once; first come, first served would put it behind
the fan-out's 64 generations (~400 steps). On a real model the step it shares also grows by the decode rows
it runs beside; `trillm bench soak --hostile` measures that part (docs/performance.md).
"""

from __future__ import annotations

import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
import trio.testing

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.mock import StepShape, make_mock_engine
from trillm.web.config import ServerConfig
from trillm.web.server import ModelSpec, serve

from conftest import SPEC

STEP_S = 0.01
CONFIG = EngineConfig(num_kv_blocks=2048, max_num_seqs=8, max_num_batched_tokens=64, max_waiting=256)
PHASES = (0.3, 0.5, 0.7)  # where in a running step each short request arrives, in steps


class FixedSteps:
    """The mock's timing model: each step that runs anything costs STEP_S."""

    def step_seconds(self, shape: StepShape) -> float:
        return STEP_S if shape.decode_contexts or shape.prefill_chunks else 0.0


class Engines:
    def __init__(self) -> None:
        self.engines: list[LLMEngine] = []

    def __call__(self) -> LLMEngine:
        self.engines.append(make_mock_engine(CONFIG, spec=SPEC, perf=FixedSteps()))
        return self.engines[-1]


@asynccontextmanager
async def live_server() -> AsyncIterator[tuple[httpx.AsyncClient, LLMEngine]]:
    engines = Engines()
    async with trio.open_nursery() as nursery:
        serving = await nursery.start(serve, [ModelSpec(None, engines, inline=True)],
                                      ServerConfig(host="127.0.0.1", port=0))
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            yield client, engines.engines[-1]
        nursery.cancel_scope.cancel()


async def ttft(client: httpx.AsyncClient, label: str) -> float:
    """The median TTFT, in steps, of short streamed requests (a fresh 24-word prompt each, one token), one
    after another, each arriving at one of PHASES of a step."""
    out = []
    for i, phase in enumerate(PHASES * 3):
        body = {"prompt": f"{label} {i} " + "words of a short prompt " * 5, "max_tokens": 1, "stream": True}
        t0 = trio.current_time()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    out.append((trio.current_time() - t0) / STEP_S)
                    break
        # The first token came with a step's end: wait into the next step (idle: the server just waits).
        await trio.sleep(phase * STEP_S)
    return statistics.median(out)


async def running(engine: LLMEngine, at_least: int) -> None:
    with trio.fail_after(30):
        while len(engine.scheduler.running) < at_least:
            await trio.sleep(STEP_S / 4)


async def test_a_short_requests_ttft_beside_a_fan_out_to_the_cap_is_under_twice_idle(
        autojump_clock: trio.testing.MockClock) -> None:
    async with live_server() as (client, engine):
        await ttft(client, "warm-up")
        idle = await ttft(client, "idle")
        async with trio.open_nursery() as nursery:
            async def stream(body: dict[str, Any]) -> None:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():
                        pass

            long = {"max_tokens": 400, "stream": True, "ignore_eos": True}
            nursery.start_soon(stream, {"prompt": "one long request", **long})
            await running(engine, 1)
            beside_one = await ttft(client, "beside one")
            nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:
            # 32 prompts x n 2: the 64 generations one request may queue under max_waiting 256 (one more is a
            # 400: test_fair_service.py). Alone it takes every row of the batch.
            nursery.start_soon(stream, {"prompt": [f"fan-out prompt {i}" for i in range(32)], "n": 2, **long})
            await running(engine, 8)
            assert {s.group for s in engine.scheduler.running} == {engine.scheduler.running[0].group}
            beside_fan_out = await ttft(client, "beside the fan-out")
            sched = engine.scheduler
            assert len(sched.running) == 8 and len(sched.waiting) > 40  # still fanned out
            assert sched.num_preemptions >= 1  # the rows the short requests took
            nursery.cancel_scope.cancel()
    figures = f"median TTFT in steps: idle {idle:.2f}, beside one request {beside_one:.2f}, beside the fan-out " \
              f"{beside_fan_out:.2f}"
    print(figures)
    assert abs(idle - 1) < 1e-6, figures  # the step that computes its prompt
    assert beside_fan_out <= beside_one + 1e-6, figures  # the fan-out's 56 waiting generations are not ahead of it
    assert beside_fan_out < 2 * idle, figures  # first come, first served: ~400x
