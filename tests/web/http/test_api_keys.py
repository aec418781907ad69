"""--api-key-file: named keys, each with requests per minute and requests in flight; over a limit a 429 with
Retry-After in each API's error shape; the key's name (never the key) in logs and /metrics. On trio's
MockClock (the inline mock engine)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from trillm.engine.llm_engine import LLMEngine
from trillm.engine.mock import LinearCostModel, make_mock_engine
from trillm.web.app import create_app
from trillm.web.config import ServerConfig
from trillm.web.http.keys import KeyFileError, parse_key_file
from trillm.web.service.engine_service import EngineService

from conftest import DEFAULT_CONFIG, SPEC, parse_sse

ALICE, BOB, ADMIN = "sk-alice-0123456789", "sk-bob-abcdefghij", "sk-admin-zzzzzzzz"
KEY_FILE = f"""
# name key [rpm=N] [concurrent=N]
alice {ALICE} rpm=2
bob   {BOB}   concurrent=1
"""


def _engine() -> LLMEngine:
    return make_mock_engine(DEFAULT_CONFIG, spec=SPEC, perf=LinearCostModel(0.01, 0.0, 0.0, 0.01, 0.0, 0.0))


@asynccontextmanager
async def keyed_app(**server: Any) -> AsyncIterator[Any]:
    async with trio.open_nursery() as nursery:
        service = await nursery.start(EngineService(_engine, inline=True).run)
        config = ServerConfig(api_keys=tuple(parse_key_file(KEY_FILE)), **server)
        yield create_app([service], config).test_client()
        nursery.cancel_scope.cancel()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


COMPLETION = {"prompt": "a b", "max_tokens": 2}


def test_key_file_parsing() -> None:
    keys = parse_key_file(KEY_FILE, default_rpm=100)
    assert [(k.name, k.rpm, k.max_concurrent) for k in keys] == [("alice", 2, None), ("bob", 100, 1)]
    assert all(ALICE not in repr(k) and BOB not in repr(k) for k in keys)  # only a digest is kept
    for bad, why in ((f"alice {ALICE}\nalice {BOB}", "twice"), (f"a {ALICE}\nb {ALICE}", "twice"),
                     ("alice short", "shorter"), (f"alice {ALICE} {BOB}", "option"), (f"alice {ALICE} rpm=0", "option"),
                     (f"alice {ALICE} burst=3", "option"), ("# nothing\n", "no keys"), ("x" * 70 + f" {ALICE}", "name")):
        with pytest.raises(KeyFileError, match=why) as info:
            parse_key_file(bad)
        assert ALICE not in str(info.value) and BOB not in str(info.value)


async def test_keys_authenticate_and_rpm_refuses_with_retry_after(autojump_clock: trio.testing.MockClock,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trillm.web.http.keys")
    async with keyed_app(api_key=ADMIN) as client:
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 401  # a key is needed
        assert (await client.post("/v1/completions", json=COMPLETION, headers=bearer("sk-nobody-00000"))
                ).status_code == 401
        for _ in range(2):  # alice's burst: 2
            assert (await client.post("/v1/completions", json=COMPLETION, headers=bearer(ALICE))).status_code == 200
        r = await client.post("/v1/completions", json=COMPLETION, headers=bearer(ALICE))
        assert r.status_code == 429
        assert 1 <= int(r.headers["Retry-After"]) <= 30  # 2 a minute: the next token within 30 s
        err = (await r.get_json())["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limited" and "alice" in err["message"]
        r = await client.post("/v1/messages", headers={"x-api-key": ALICE},  # Anthropic's shape on its path
                              json={"model": "mock-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and "Retry-After" in r.headers
        assert (await r.get_json())["type"] == "error" and (await r.get_json())["error"]["type"] == "rate_limit_error"
        await trio.sleep(31)  # a token came back
        assert (await client.post("/v1/completions", json=COMPLETION, headers=bearer(ALICE))).status_code == 200
        for _ in range(5):  # --api-key itself is not limited
            assert (await client.post("/v1/completions", json=COMPLETION, headers=bearer(ADMIN))).status_code == 200
        assert (await client.get("/health")).status_code == 200  # unprotected paths need no key
        metrics = await (await client.get("/metrics")).get_data(as_text=True)
    assert 'trillm_api_key_requests_total{key_name="alice",outcome="admitted"} 3' in metrics
    assert 'trillm_api_key_requests_total{key_name="alice",outcome="rate_limited"} 2' in metrics
    assert 'trillm_api_key_requests_in_flight{key_name="alice"} 0' in metrics
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "alice" in logged and "rate_limited" in logged
    for secret in (ALICE, BOB, ADMIN):
        assert secret not in metrics and secret not in logged


async def test_concurrency_per_key_counts_streams_to_their_end(autojump_clock: trio.testing.MockClock) -> None:
    async with keyed_app() as client:
        results: list[int] = []

        async def slow() -> None:  # 100 tokens at 10 ms a step: in flight for about a second
            r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 100, "ignore_eos": True},
                                  headers=bearer(BOB))
            results.append(r.status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow)
            await trio.sleep(0.3)
            r = await client.post("/v1/completions", json=COMPLETION, headers=bearer(BOB))
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert (await r.get_json())["error"]["code"] == "concurrency_limited"
            # Another key is not affected.
            assert (await client.post("/v1/completions", json=COMPLETION, headers=bearer(ALICE))).status_code == 200
        assert results == [200]
        # A stream holds its place until its end, then gives it back.
        r = await client.post("/v1/completions", json={**COMPLETION, "stream": True}, headers=bearer(BOB))
        assert parse_sse(await r.get_data())[-1] == "[DONE]"
        metrics = await (await client.get("/metrics")).get_data(as_text=True)
        assert 'trillm_api_key_requests_in_flight{key_name="bob"} 0' in metrics
        assert (await client.post("/v1/completions", json=COMPLETION, headers=bearer(BOB))).status_code == 200
        assert 'key_name="bob",outcome="concurrency_limited"} 1' in metrics


async def test_the_official_sdks_see_a_rate_limit_error() -> None:
    """Through a live server: OpenAI's and Anthropic's own clients raise their RateLimitError, with Retry-After."""
    import anthropic
    import openai

    from conftest import MockFactory, running_server

    async with running_server(MockFactory(), api_keys=tuple(parse_key_file(f"alice {ALICE} rpm=1"))) as serving:
        oai = openai.AsyncOpenAI(base_url=serving.url + "/v1", api_key=ALICE, max_retries=0)
        await oai.completions.create(model="mock-model", prompt="a", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as info:
            await oai.completions.create(model="mock-model", prompt="a", max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) >= 1
        claude = anthropic.AsyncAnthropic(base_url=serving.url, api_key=ALICE, max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as ainfo:
            await claude.messages.create(model="mock-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert ainfo.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
