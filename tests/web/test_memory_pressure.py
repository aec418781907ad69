"""Memory pressure through HTTP: with --memory-limit far below what the offered load wants, the requests the
pool cannot hold are refused, the others complete, and the server stays up (no crash, no hang, no restart).

A non-streamed refusal is a 503 with Retry-After. A streamed one is refused on the engine thread after the
stream's headers went out (the memory check needs the block manager's state; admission on the trio thread
reads only fixed facts), so it is a 200 whose only event is an `overloaded` error, then [DONE].

The real engine on the tiny model (the mock has no pool to grow), with the budget's reading of the process
pinned to a fixed amount outside the pool plus the pool itself, as tests/engine/test_kv_slabs.py does, so
the limit leaves room for exactly ROOM_BLOCKS blocks whatever the test process holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
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
    results: list[tuple[int, dict[str, str], Any]] = []
    async with running_server(factory) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:

            async def one(stream: bool) -> None:
                r = await client.post("/v1/completions", json={**body, "stream": stream})
                results.append((r.status_code, dict(r.headers), r.content))

            with trio.fail_after(120):  # a hang fails here, not in CI's timeout
                async with trio.open_nursery() as nursery:
                    for i in range(24):  # ~144 blocks offered against room for 24
                        nursery.start_soon(one, i % 2 == 1)
            statuses = sorted(s for s, _, _ in results)
            assert set(statuses) <= {200, 503}, statuses
            refused = [(h, c) for s, h, c in results if s == 503]
            streamed_refused = [c for s, _, c in results if s == 200 and b'"code":"overloaded"' in c]
            served = [c for s, _, c in results if s == 200 and b'"code":"overloaded"' not in c]
            assert refused and streamed_refused and served, statuses
            for headers, content in refused:
                assert int(headers["retry-after"]) >= 1
                assert b"--memory-limit" in content
            for content in streamed_refused:
                assert b"--memory-limit" in content and content.endswith(b"data: [DONE]\n\n")
                assert b'"choices"' not in content
            for content in served:  # complete: 8 tokens each, streamed or not
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
