"""Round 2 of the request boundary (issue 25): what one request may cost, and what it may not break.

Each test here failed before its fix: malformed grammar options, seeds near the top of their range, oversized
single deltas, grammars evicted from the compiler's cache, oversized bodies of every API, fan-out and response
size caps, DNS-rebinding origins, and cache salts on the agent APIs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from conftest import MockFactory, running_server

MESSAGES = [{"role": "user", "content": "Where is Paris?"}]


@asynccontextmanager
async def live_client(factory: Any, **server: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with running_server(factory, **server) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            yield client


# ---- malformed grammar options: a clean 400, never a 500 ----

async def test_malformed_x_guidance_is_a_400_not_a_500() -> None:
    factory = MockFactory()
    async with live_client(factory) as client:
        for options in ("fast", 3, [1], {"whitespace_flexible": "yes"}, {"bogus": 1}):
            schema = {"type": "object", "x-guidance": options}
            for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                          {"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
                r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **extra})
                assert r.status_code == 400, (options, extra, r.text)
                assert r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                        "guided_json": {"type": "object", "x-guidance": "fast"}})
        assert r.status_code == 400 and "x-guidance" in r.json()["error"]["message"], r.text
        assert factory.engine.statistics().num_steps == 0


# ---- per-choice seeds never overflow ----

async def test_a_seed_at_the_top_of_its_range_with_n_choices_is_served_and_reproducible() -> None:
    from trillm.web.openai_schema import MAX_SEED

    async with live_client(MockFactory()) as client:
        async def texts(seed: int, n: int) -> list[str]:
            r = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 12, "n": n, "seed": seed,
                                                            "temperature": 1.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

        for seed in (MAX_SEED, MAX_SEED - 1, -MAX_SEED):
            first = await texts(seed, 4)
            assert await texts(seed, 4) == first  # reproducible
            assert (await texts(seed, 1))[0] == first[0]  # choice 0 runs under the seed as given
            assert len(set(first)) > 1  # the choices differ
        # choice 1 of the top seed is the bottom seed: wrapped, not clamped (which would repeat choice 0)
        from trillm.web.protocol import choice_seed

        assert choice_seed(MAX_SEED, 1) == -MAX_SEED
        assert (await texts(MAX_SEED, 2))[1] == (await texts(-MAX_SEED, 1))[0]
