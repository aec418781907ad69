"""Memory pressure through HTTP: with --memory-limit far below what the offered load wants, the requests the
pool cannot hold are refused, the others complete, and the server stays up (no crash, no hang, no restart).

A refusal is a 503 with Retry-After, streamed or not: the memory check runs on the engine thread (it needs the
block manager's state), and a stream's headers wait for the engine's verdict on adding the request, on every
streamed surface (OpenAI chat and text completions, Anthropic messages, Responses), as the official clients see.

The real engine on the tiny model (the mock has no pool to grow), with the budget's reading of the process
pinned to a fixed amount outside the pool plus the pool itself, as tests/engine/test_kv_slabs.py does, so
the limit leaves room for exactly ROOM_BLOCKS blocks whatever the test process holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.memory import MemoryBudget

from conftest import running_server

ROOM_BLOCKS = 24
OUTSIDE = 10**9  # what the process holds beside the pool, as the budget reads it


class PinnedMemoryFactory:
    """A real engine with --memory-limit leaving room for ROOM_BLOCKS KV blocks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.engines: list[LLMEngine] = []

    def __call__(self) -> LLMEngine:
        probe = EngineConfig(model=str(self.path), block_size=16, num_kv_blocks=512, max_num_seqs=16,
                             max_num_batched_tokens=128, kv_slab_mb=0.0625, verify_model=False)
        engine = LLMEngine(probe)
        cap = engine.pool_capacity
        assert cap is not None
        limit = OUTSIDE + int(ROOM_BLOCKS * cap.bytes_per_block * (1 + 1 / cap.num_arrays))
        cap.budget = engine.memory = MemoryBudget(limit, usage=lambda: OUTSIDE + cap.nbytes, max_age_s=0)
        assert cap.budget_bound
        self.engines.append(engine)
        return engine


async def test_memory_limit_refuses_with_503_and_retry_after_and_serves_the_rest(tiny_model_path: Path) -> None:
    factory = PinnedMemoryFactory(tiny_model_path)
    prompt = "the quick brown fox jumps over the lazy dog " * 8  # ~6 blocks of the tiny model's tokens
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    results: list[tuple[bool, int, dict[str, str], Any]] = []
    async with running_server(factory) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:

            async def one(stream: bool) -> None:
                r = await client.post("/v1/completions", json={**body, "stream": stream})
                results.append((stream, r.status_code, dict(r.headers), r.content))

            with trio.fail_after(120):  # a hang fails here, not in CI's timeout
                async with trio.open_nursery() as nursery:
                    for i in range(24):  # ~144 blocks offered against room for 24
                        nursery.start_soon(one, i % 2 == 1)
            statuses = sorted(s for _, s, _, _ in results)
            assert set(statuses) <= {200, 503}, statuses
            refused = [(h, c) for _, s, h, c in results if s == 503]
            served = [c for _, s, _, c in results if s == 200]
            assert served and {stream for stream, s, _, _ in results if s == 503} == {False, True}, statuses
            for headers, content in refused:  # streamed ones too: JSON errors, not event streams
                assert int(headers["retry-after"]) >= 1 and headers["content-type"].startswith("application/json")
                assert b"--memory-limit" in content and b'"code":"overloaded"' in content.replace(b" ", b"")
            for content in served:  # complete: 8 tokens each, streamed or not
                assert b'"code":"overloaded"' not in content.replace(b" ", b"")
                text = content.decode().replace(" ", "")
                assert '"finish_reason":"length"' in text, text[-300:]
            # Still up, and a request that fits is served once the load is gone.
            assert (await client.get("/health")).status_code == 200
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
    engine = factory.engines[-1]
    cap = engine.pool_capacity
    assert cap is not None and cap.capacity <= ROOM_BLOCKS
    assert len(factory.engines) == 1  # no engine restart


async def test_a_streamed_refusal_is_a_503_with_retry_after_on_every_surface(tiny_model_path: Path) -> None:
    """A prompt the memory limit can never hold (but the configured pool could, so the trio thread's own check
    passes it): every streamed surface answers 503 (Anthropic's: 529 overloaded_error) with Retry-After before
    any event, as the official clients raise it, and the same surfaces stream a prompt that fits."""
    factory = PinnedMemoryFactory(tiny_model_path)
    huge = "the quick brown fox jumps over the lazy dog " * 48  # ~36 blocks against room for 24
    async with running_server(factory) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            oai = openai.AsyncOpenAI(base_url=serving.url + "/v1", api_key="k", max_retries=0)
            claude = anthropic.AsyncAnthropic(base_url=serving.url, api_key="k", max_retries=0)

            def surfaces(text: str) -> dict[str, Any]:
                messages: Any = [{"role": "user", "content": text}]
                return {
                    "chat": oai.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=True),
                    "completions": oai.completions.create(model=model, prompt=text, max_tokens=4, stream=True),
                    "responses": oai.responses.create(model=model, input=text, max_output_tokens=16, stream=True),
                    "messages": claude.messages.create(model=model, messages=messages, max_tokens=4, stream=True),
                }

            with trio.fail_after(120):
                for surface, call in surfaces(huge).items():
                    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as info:
                        await call
                    response = info.value.response
                    if surface == "messages":  # Anthropic's status for it: 529 overloaded_error
                        assert isinstance(info.value, anthropic.OverloadedError), info.value
                    assert response.status_code == (529 if surface == "messages" else 503), (surface, response)
                    assert int(response.headers["retry-after"]) >= 1, surface
                    assert response.headers["content-type"].startswith("application/json"), surface
                    assert "--memory-limit" in response.text, (surface, response.text)
                for surface, call in surfaces("the quick brown fox").items():
                    events = [event async for event in await call]
                    assert len(events) >= 3, (surface, events)  # streamed, not refused
            metrics = (await client.get("/metrics")).text
            assert 'trillm_requests_total{model="%s",outcome="rejected"} 4' % model in metrics
    assert len(factory.engines) == 1  # no engine restart
