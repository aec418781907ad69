"""Request deadlines (--request-timeout, X-Request-Timeout) on trio's MockClock: past its deadline a generation
ends with finish reason "timeout" (OpenAI's finish_reason; Anthropic's stop_reason max_tokens; the Responses
API's incomplete), its engine request is aborted and its KV blocks are freed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from trillm.engine.llm_engine import LLMEngine
from trillm.engine.mock import LinearCostModel, make_mock_engine
from trillm.engine.outputs import FinishReason
from trillm.engine.sampling_params import SamplingParams
from trillm.web.app import create_app
from trillm.web.config import ServerConfig
from trillm.web.service.engine_service import EngineService

from conftest import DEFAULT_CONFIG, SPEC, parse_sse

STEP_S = 0.01  # each decode step takes 10 ms of (virtual) time
LONG = 1500  # tokens: 15 s of decoding, far past every deadline here


class SlowInline:
    def __init__(self) -> None:
        self.engines: list[LLMEngine] = []

    def __call__(self) -> LLMEngine:
        perf = LinearCostModel(STEP_S, 0.0, 0.0, STEP_S, 0.0, 0.0)
        engine = make_mock_engine(DEFAULT_CONFIG, spec=SPEC, perf=perf)
        self.engines.append(engine)
        return engine


@asynccontextmanager
async def inline_app(**server: Any) -> AsyncIterator[tuple[Any, EngineService, LLMEngine]]:
    factory = SlowInline()
    async with trio.open_nursery() as nursery:
        service = await nursery.start(EngineService(factory, inline=True).run)
        yield create_app([service], ServerConfig(**server)).test_client(), service, factory.engines[-1]
        nursery.cancel_scope.cancel()


async def assert_freed(engine: LLMEngine) -> None:
    await trio.sleep(5 * STEP_S)  # the abort reaches the engine with the next step
    assert not engine.scheduler.has_work()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


async def test_handle_times_out_and_frees_its_blocks(autojump_clock: trio.testing.MockClock) -> None:
    async with inline_app() as (_, service, engine):
        t0 = trio.current_time()
        handle = service.submit([5, 6, 7], SamplingParams(max_tokens=LONG, ignore_eos=True), deadline=t0 + 0.5)
        outs = []
        with handle:
            while True:
                try:
                    outs.append(await handle.receive())
                except trio.EndOfChannel:
                    break
        elapsed = trio.current_time() - t0
        assert 0.5 <= elapsed < 0.5 + 2 * STEP_S, elapsed
        assert outs[-1].finish_reason is FinishReason.TIMEOUT
        tokens = sum(len(o.new_token_ids) for o in outs)
        assert 0.5 / STEP_S - 5 <= tokens < 0.5 / STEP_S + 2  # it generated until the deadline, then stopped
        assert outs[-1].usage.completion_tokens == tokens and outs[-1].usage.prompt_tokens == 3
        assert service.metrics.outcomes["timeout"] == 1 and service.metrics.outcomes["abort"] == 0
        await assert_freed(engine)


async def test_chat_completions_header_and_server_default(autojump_clock: trio.testing.MockClock) -> None:
    async with inline_app(request_timeout_s=2.0) as (client, _, engine):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "ignore_eos": True}
        t0 = trio.current_time()
        r = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Timeout": "0.3"})
        assert r.status_code == 200
        choice = (await r.get_json())["choices"][0]
        assert choice["finish_reason"] == "timeout" and choice["message"]["content"]
        assert 0.3 <= trio.current_time() - t0 < 0.4
        await assert_freed(engine)
        t0 = trio.current_time()  # a header asking for more than the server allows gets the server's 2 s
        r = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Timeout": "60"})
        assert (await r.get_json())["choices"][0]["finish_reason"] == "timeout"
        assert 2.0 <= trio.current_time() - t0 < 2.1
        await assert_freed(engine)
        r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 3})  # in time: unaffected
        assert (await r.get_json())["choices"][0]["finish_reason"] == "length"
        for bad in ("0", "-1", "soon", "nan", "inf"):
            r = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Timeout": bad})
            assert r.status_code == 400 and (await r.get_json())["error"]["code"] == "invalid_request_timeout"
        metrics = (await (await client.get("/metrics")).get_data(as_text=True))
        assert 'trillm_requests_total{model="mock-model",outcome="timeout"} 2' in metrics
        assert 'vllm:request_success_total{model_name="mock-model",engine="0",finished_reason="abort"} 2.0' in metrics


async def test_streams_end_with_the_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async with inline_app() as (client, _, engine):
        body = {"prompt": "a b c", "max_tokens": LONG, "ignore_eos": True, "stream": True}
        # (Short: quart's test client holds 10 chunks before the test reads them.)
        r = await client.post("/v1/completions", json=body, headers={"X-Request-Timeout": "0.05"})
        events = parse_sse(await r.get_data())
        assert events[-1] == "[DONE]"
        reasons = [c["finish_reason"] for e in events[:-1] for c in e.get("choices", [])]
        assert reasons[-1] == "timeout" and set(reasons[:-1]) == {None} and len(reasons) >= 3
        await assert_freed(engine)


async def test_anthropic_and_responses_shapes(autojump_clock: trio.testing.MockClock) -> None:
    async with inline_app() as (client, _, engine):
        r = await client.post("/v1/messages", json={"model": "mock-model", "max_tokens": LONG,
                                                    "messages": [{"role": "user", "content": "hi"}]},
                              headers={"X-Request-Timeout": "0.2"})
        msg = await r.get_json()
        assert r.status_code == 200 and msg["stop_reason"] == "max_tokens" and msg["content"][0]["text"], msg
        await assert_freed(engine)
        r = await client.post("/v1/messages", headers={"X-Request-Timeout": "0.04"},
                              json={"model": "mock-model", "max_tokens": LONG, "stream": True,
                                    "messages": [{"role": "user", "content": "hi"}]})
        text = (await r.get_data()).decode()
        deltas = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: ") and '"message_delta"' in line]
        assert deltas and deltas[-1]["delta"]["stop_reason"] == "max_tokens"
        r = await client.post("/v1/responses", json={"model": "mock-model", "input": "hi", "max_output_tokens": LONG},
                              headers={"X-Request-Timeout": "0.2"})
        resp = await r.get_json()
        assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "timeout"}, resp
        await assert_freed(engine)


async def test_deadline_before_the_generation_starts_is_a_504(autojump_clock: trio.testing.MockClock) -> None:
    """A model still loading when the deadline passes: the client gets a 504, in time, not a hung request."""
    service = EngineService(SlowInline(), name="mock-model", inline=True)  # never run: it stays LOADING
    client = create_app([service], ServerConfig()).test_client()
    t0 = trio.current_time()
    r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers={"X-Request-Timeout": "0.5"})
    assert r.status_code == 504 and (await r.get_json())["error"]["code"] == "request_timeout"
    assert 0.5 <= trio.current_time() - t0 < 0.6


async def test_a_client_that_stops_reading_still_times_out(autojump_clock: trio.testing.MockClock) -> None:
    """The service expires deadlines on each step, so the blocks are freed even while nobody receives."""
    async with inline_app() as (_, service, engine):
        handle = service.submit([5, 6, 7], SamplingParams(max_tokens=LONG, ignore_eos=True),
                                deadline=trio.current_time() + 0.3)
        await trio.sleep(0.3 + 2 * STEP_S)
        await assert_freed(engine)
        with handle:
            outs = []
            while True:
                try:
                    outs.append(await handle.receive())
                except trio.EndOfChannel:
                    break
        assert outs[-1].finish_reason is FinishReason.TIMEOUT
        assert 0 < sum(len(o.new_token_ids) for o in outs) <= 0.3 / STEP_S + 2
