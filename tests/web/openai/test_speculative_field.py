"""The per-request opt-out of speculative decoding crosses the boundary (and a bad value is a 400), and the
engine's speculation statistics reach /metrics."""

from __future__ import annotations

from typing import Any

import httpx

from conftest import MockFactory, running_server


async def test_speculative_false_reaches_the_engine_a_bad_value_is_a_400_and_metrics_show_it() -> None:
    factory = MockFactory()
    async with running_server(factory) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
            seen: list[bool] = []
            real = factory.engine.add_request

            def spy(request_id: str, prompt: list[int], params: Any, **kw: Any) -> None:
                seen.append(params.speculative)
                real(request_id, prompt, params, **kw)

            factory.engine.add_request = spy  # type: ignore[method-assign]
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "a", "max_tokens": 3})):
                for extra in ({}, {"speculative": False}):
                    r = await client.post(path, json=body | extra)
                    assert r.status_code == 200, r.text
                r = await client.post(path, json=body | {"speculative": "no"})
                assert r.status_code == 400 and "speculative" in r.text, r.text
            assert seen == [True, False, True, False]
            text = (await client.get("/metrics")).text
            assert "trillm_spec_acceptance_rate{" in text and "trillm_spec_tokens_per_verify{" in text
