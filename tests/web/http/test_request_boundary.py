"""The request boundary's bounds on cost: what one request may cost, and what it may not break.

Each test here failed before its fix: malformed grammar options, seeds near the top of their range, oversized
single deltas, grammars evicted from the compiler's cache, oversized bodies of every API, fan-out and response
size caps, DNS-rebinding origins, and cache salts on the agent APIs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from conftest import DEFAULT_CONFIG, MockFactory, running_server

MESSAGES = [{"role": "user", "content": "Where is Paris?"}]
DEFAULT_BLOCK = DEFAULT_CONFIG.block_size


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
    from trillm.web.openai.schema import MAX_SEED

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
        from trillm.web.openai.request import choice_seed

        assert choice_seed(MAX_SEED, 1) == -MAX_SEED
        assert (await texts(MAX_SEED, 2))[1] == (await texts(-MAX_SEED, 1))[0]


# ---- one streamed delta over the buffered-bytes budget ----

def test_one_delta_over_the_budget_is_delivered_when_nothing_else_is_unread() -> None:
    from trillm.engine.outputs import RequestOutput, TokenLogprob, Usage
    from trillm.web.service.stream import GenerationFailed, GenerationHandle, buffered_size

    lps = tuple(TokenLogprob(5, -1.0, tuple((t, -2.0) for t in range(20)), 1) for _ in range(100))

    def delta(text: str, prompt_logprobs: Any = None) -> RequestOutput:
        return RequestOutput("r", (7,), text, None, Usage(3, 1, 0), prompt_logprobs=prompt_logprobs)

    big = delta("a", lps)
    assert buffered_size(big) > 4096
    handle = GenerationHandle(("r",), abort=lambda rid: None, channel_size=4, max_buffered_bytes=4096)
    handle.feed(big)
    assert handle.receive_nowait() is big  # delivered, not failed
    handle.feed(delta("b"))
    assert handle.receive_nowait().new_text == "b"
    # still bounded: an oversized delta on top of unread output fails the stream
    handle.feed(delta("c"))
    handle.feed(delta("d", lps))
    try:
        handle.receive_nowait()
    except GenerationFailed as exc:
        assert "read too slowly" in str(exc)
    else:
        raise AssertionError("an oversized delta on top of unread output must fail")
    # and a client that never reads gets the big delta plus at most the budget on top of it
    handle = GenerationHandle(("r",), abort=lambda rid: None, channel_size=4, max_buffered_bytes=4096)
    handle.feed(big)
    for _ in range(4096 // buffered_size(delta("x" * 100)) + 1):
        handle.feed(delta("x" * 100))
    try:
        handle.receive_nowait()
    except GenerationFailed:
        pass
    else:
        raise AssertionError("output on top of the exempt delta counts against the budget")


async def test_a_streamed_prompt_logprobs_delta_over_the_budget_is_served() -> None:
    prompt = " ".join(f"w{i}" for i in range(300))
    async with live_client(MockFactory(), service_config={"max_buffered_bytes": 16 << 10}) as client:
        async with client.stream("POST", "/v1/completions", json={
                "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 20, "stream": True, "ignore_eos": True}) as r:
            body = (await r.aread()).decode()
        assert r.status_code == 200, body
        assert "read too slowly" not in body and "data: [DONE]" in body
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        plps = [c["prompt_logprobs"] for e in events for c in e["choices"] if c.get("prompt_logprobs")]
        assert len(plps) == 1 and len(plps[0]) > 100


# ---- a grammar evicted from the compiler's cache is never compiled on the engine thread ----

async def test_the_engine_thread_never_compiles_a_grammar_evicted_after_validation(monkeypatch: Any) -> None:
    import threading

    from trillm.engine import grammar

    compiled_on: list[int] = []
    real_text, real_validate = grammar._grammar_text, grammar.GrammarCompiler.validate

    def recording_text(spec: grammar.GrammarSpec) -> str:
        compiled_on.append(threading.get_ident())
        return real_text(spec)

    def validate_then_evict(self: grammar.GrammarCompiler, spec: grammar.GrammarSpec) -> grammar.GrammarSpec:
        out = real_validate(self, spec)
        with self._lock:  # as if 256 other grammars had come through before this one was queued
            self._cache.clear()
        return out

    monkeypatch.setattr(grammar, "_grammar_text", recording_text)
    monkeypatch.setattr(grammar.GrammarCompiler, "validate", validate_then_evict)
    factory = MockFactory()
    async with live_client(factory) as client:
        for body in ({"prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{3}"},
                     {"prompt": "y", "max_tokens": 8, "guided_choice": ["yes", "no"]}):
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 8, "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
    assert len(compiled_on) >= 3  # each was compiled (at validation)...
    assert not set(compiled_on) & set(factory.threads)  # ...and never on the engine thread


# ---- every API's text counts toward --max-prompt-bytes, and large bodies are worked on off the event loop ----

def _big_bodies(size: int) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Bodies of about `size` bytes whose bulk is not message content: tool arguments, tool results, tool
    schemas (OpenAI chat, Anthropic's Messages, OpenAI's Responses)."""
    blob = "x" * size
    obj = {f"k{i}": "v" * 24 for i in range(size // 40)}  # a deep-ish object: costly to parse and re-encode
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": blob})}}
    chat = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "go"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{**call, "function": {
            "name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": blob}]},
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": obj}}}]},
    ]
    messages = [
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": obj}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]},
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": blob}]}]},
        {"messages": MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object", "properties": obj}}]},
    ]
    responses = [
        {"input": [{"role": "user", "content": "hi"},
                   {"type": "function_call", "call_id": "c1", "name": "f", "arguments": json.dumps({"a": blob})},
                   {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
        {"input": [{"role": "user", "content": "hi"},
                   {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1", "output": blob}]},
        {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object",
                                                                                      "properties": obj}}]},
    ]
    return {"/v1/chat/completions": [("chat", {"max_tokens": 4, **b}) for b in chat],
            "/v1/messages": [("messages", {"model": "mock-model", "max_tokens": 4, **b}) for b in messages],
            "/v1/responses": [("responses", {"model": "mock-model", "max_output_tokens": 4, **b}) for b in responses]}


class _LoopSteps:
    """A trio instrument: the longest CPU time the event loop's thread spent in one task step. Load-independent
    (a step waiting for the GIL or for a core costs no CPU time): what a request blocking everyone else costs."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._t0: float | None = None  # None: the step that added the instrument (its start was not seen)

    def before_task_step(self, task: Any) -> None:
        import time

        self._t0 = time.thread_time()

    def after_task_step(self, task: Any) -> None:
        import time

        if self._t0 is not None:
            self.longest = max(self.longest, time.thread_time() - self._t0)
        self._t0 = None


async def test_oversized_bodies_of_every_api_get_their_400_while_a_stream_keeps_flowing() -> None:
    import time

    import trio

    size = 3_900_000  # under --max-request-bytes (4 MiB), far over --max-prompt-bytes (1 MiB)
    encoded = [(path, api, json.dumps(body).encode()) for path, cases in _big_bodies(size).items()
               for api, body in cases]
    assert all(3_000_000 < len(data) <= 4 << 20 for _, _, data in encoded)
    async with live_client(MockFactory(step_delay=0.005)) as client:
        arrivals: list[float] = []
        flowing, done = trio.Event(), trio.Event()

        async def stream() -> None:
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "a b c", "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())
                        flowing.set()
                    if done.is_set():
                        return

        steps = _LoopSteps()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            await flowing.wait()
            start = time.perf_counter()
            trio.lowlevel.add_instrument(steps)
            try:
                for path, api, data in encoded:
                    r = await client.post(path, content=data, headers={"Content-Type": "application/json"})
                    assert r.status_code == 400, (api, r.text[:300])
                    message = r.json()["error"]["message"]
                    assert "--max-prompt-bytes" in message, (api, message)
            finally:
                trio.lowlevel.remove_instrument(steps)
            end = time.perf_counter()
            done.set()
        # Nothing of those bodies ran on the event loop for long (parsing, translating, templating: a thread)...
        assert steps.longest < 0.05, steps.longest
        # ...so the stream kept flowing: no multi-second stall, even on a loaded machine (the figure on
        # an idle one is 0.5 s; what is left is the GIL held by pydantic's parser of a 4 MB object).
        during = [t for t in arrivals if start <= t <= end]
        gaps = [b - a for a, b in zip(during, during[1:])]
        assert len(during) > 20 and max(gaps) < 1.5, (len(during), max(gaps, default=None))


async def test_large_bodies_are_parsed_translated_and_templated_off_the_event_loop(monkeypatch: Any) -> None:
    import threading

    from trillm.web.anthropic import routes as messages_routes
    from trillm.web.http import body as http_body
    from trillm.web.openai import submit
    from trillm.web.responses import routes as responses_routes

    where: dict[str, set[int]] = {}

    def recorded(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            where.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(http_body, "parse_body", recorded("parse", http_body.parse_body))
    monkeypatch.setattr(messages_routes, "chat_body", recorded("translate", messages_routes.chat_body))
    monkeypatch.setattr(responses_routes, "chat_body", recorded("translate", responses_routes.chat_body))
    monkeypatch.setattr(submit, "parse_generation", recorded("template", submit.parse_generation))
    loop_thread = threading.get_ident()
    async with live_client(MockFactory()) as client:
        for path, cases in _big_bodies(100_000).items():  # well under every limit: these are served
            for api, body in cases[:2]:
                r = await client.post(path, json=body)
                assert r.status_code == 200, (api, r.text[:300])
        assert set(where) == {"parse", "translate", "template"}
        assert loop_thread not in set().union(*where.values()), where
        # small bodies stay on the loop (a thread hop per request would cost more than the work)
        where.clear()
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200 and where["parse"] == where["template"] == {loop_thread}


# ---- what one request may cost: its fan-out, and its whole response when not streamed ----

async def test_fan_out_past_the_cap_is_a_400_naming_it_before_any_prompt_is_tokenized() -> None:
    import openai

    from trillm.web.openai.request import Limits

    factory = MockFactory()
    async with running_server(factory, limits=Limits(max_engine_requests=16)) as serving:
        client = openai.AsyncOpenAI(base_url=serving.url + "/v1", api_key="k", max_retries=0)
        try:
            await client.completions.create(model="mock-model", prompt=["a b"] * 5, n=4, max_tokens=2)
        except openai.BadRequestError as exc:
            assert "20 generations" in exc.message and "--max-engine-requests" in exc.message, exc.message
        else:
            raise AssertionError("5 prompts x n 4 past a cap of 16 must be refused")
        assert factory.engine.statistics().num_steps == 0
        done = await client.completions.create(model="mock-model", prompt=["a b"] * 4, n=4, max_tokens=2)
        assert len(done.choices) == 16  # at the cap: served
    async with live_client(MockFactory()) as http:  # the defaults: the 256 prompts x n 4
        r = await http.post("/v1/completions", json={"prompt": [[5, 6]] * 256, "n": 4, "max_tokens": 4000})
        assert r.status_code == 400 and "--max-engine-requests" in r.json()["error"]["message"], r.text


async def test_a_non_streamed_response_that_could_be_huge_is_refused_up_front_and_streaming_is_not() -> None:
    import openai

    factory = MockFactory()
    async with running_server(factory) as serving:  # default limits
        client = openai.AsyncOpenAI(base_url=serving.url + "/v1", api_key="k", max_retries=0)
        ask: dict[str, Any] = dict(model="mock-model", messages=MESSAGES, n=16, max_tokens=2000, logprobs=True,
                                   top_logprobs=20)
        try:
            await client.chat.completions.create(**ask)
        except openai.BadRequestError as exc:
            assert "--max-response-bytes" in exc.message and '"stream": true' in exc.message, exc.message
        else:
            raise AssertionError("16 x 2000 tokens x 21 logprobs must not be built in memory")
        # the same request streamed is served (its output leaves as it comes)
        stream = await client.chat.completions.create(**{**ask, "n": 2, "max_tokens": 5}, stream=True)
        chunks = [c async for c in stream]
        assert any(c.choices and c.choices[0].logprobs for c in chunks)
        # echo and prompt_logprobs count too: a batch of long prompts, each scored with 20 alternatives
        try:
            await client.completions.create(model="mock-model", prompt=[[5] * 1500] * 32, max_tokens=1, echo=True,
                                            logprobs=5, extra_body={"prompt_logprobs": 20})
        except openai.BadRequestError as exc:
            assert "--max-response-bytes" in exc.message, exc.message
        else:
            raise AssertionError("32 echoed prompts of 1500 tokens with 20 alternatives each must be refused")
        # ordinary requests are far under the default cap
        done = await client.chat.completions.create(model="mock-model", messages=MESSAGES, n=4, max_tokens=50,
                                                    logprobs=True, top_logprobs=5)
        assert len(done.choices) == 4
    assert factory.engine.statistics().num_steps > 0


# ---- a browser's Origin is judged against the address the server listens on, never the Host header alone ----

async def _upgrade_status(url: str, path: str, headers: dict[str, str]) -> int:
    """The status of a websocket upgrade sent by hand (so Host and Origin are exactly what a browser under DNS
    rebinding would send)."""
    import trio

    hostport = url.split("//", 1)[1]
    host, port = hostport.rsplit(":", 1)
    lines = [f"GET {path} HTTP/1.1", "Upgrade: websocket", "Connection: Upgrade", "Sec-WebSocket-Version: 13",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", *(f"{k}: {v}" for k, v in headers.items())]
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        with trio.fail_after(10):
            while b"\r\n" not in data:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                data += chunk
    return int(data.split(b" ", 2)[1])


async def test_dns_rebinding_origins_are_refused_on_the_websockets_and_internal_paths() -> None:
    async with running_server(MockFactory(), allowed_origins=("https://app.example",)) as serving:
        port = serving.url.rsplit(":", 1)[1]
        rebinding = {"Host": f"evil.test:{port}", "Origin": f"http://evil.test:{port}"}
        for path in ("/v1/ws", "/internal/kv-events"):
            assert await _upgrade_status(serving.url, path, rebinding) == 403, path
            assert await _upgrade_status(serving.url, path, {"Host": f"127.0.0.1:{port}",
                                                             "Origin": f"http://evil.test:{port}"}) == 403
            for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", "https://app.example"):
                host = f"localhost:{port}" if "app.example" not in origin else f"127.0.0.1:{port}"
                assert await _upgrade_status(serving.url, path, {"Host": host, "Origin": origin}) == 101, origin
            assert await _upgrade_status(serving.url, path, {"Host": f"127.0.0.1:{port}"}) == 101  # no browser
            # a loopback page on another port is another local site, not this server's
            assert await _upgrade_status(serving.url, path, {"Host": f"127.0.0.1:{port}",
                                                             "Origin": "http://127.0.0.1:1"}) == 403
        async with httpx.AsyncClient(base_url=serving.url) as client:
            r = await client.get("/internal/kv-events", headers=rebinding)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text


def test_origins_are_judged_against_the_bound_address() -> None:
    from trillm.web.http.guards import same_or_allowed_origin as ok

    def h(host: str, origin: str) -> dict[str, str]:
        return {"Host": host, "Origin": origin}

    # loopback bind: loopback pages on this port; never a name DNS answers for, whatever Host says
    assert ok(h("127.0.0.1:8000", "http://localhost:8000"), (), "127.0.0.1")
    assert ok(h("[::1]:8000", "http://[::1]:8000"), (), "::1")
    assert not ok(h("evil.test:8000", "http://evil.test:8000"), (), "127.0.0.1")
    assert not ok(h("192.168.1.5:8000", "http://192.168.1.5:8000"), (), "127.0.0.1")
    # a specific address: pages from that address; names only through --allowed-origin
    assert ok(h("192.168.1.5:8000", "http://192.168.1.5:8000"), (), "192.168.1.5")
    assert not ok(h("10.0.0.9:8000", "http://10.0.0.9:8000"), (), "192.168.1.5")
    assert not ok(h("box.lan:8000", "http://box.lan:8000"), (), "192.168.1.5")
    assert ok(h("box.lan:8000", "http://box.lan:8000"), ("http://box.lan:8000",), "192.168.1.5")
    # a wildcard bind: loopback pages, and a page from the address this request came to
    assert ok(h("10.0.0.9:8000", "http://10.0.0.9:8000"), (), "0.0.0.0")
    assert ok(h("localhost:8000", "http://localhost:8000"), (), "0.0.0.0")
    assert not ok(h("evil.test:8000", "http://evil.test:8000"), (), "0.0.0.0")
    assert not ok(h("10.0.0.9:8000", "http://10.0.0.8:8000"), (), "0.0.0.0")
    assert not ok(h("127.0.0.1:8000", "null"), (), "127.0.0.1")
    assert ok({"Host": "evil.test:8000"}, (), "127.0.0.1")  # no Origin: not a browser


# ---- cache_salt on every API surface ----

async def test_cache_salt_isolates_the_prefix_cache_on_messages_and_responses() -> None:
    import anthropic
    import openai

    system = " ".join(f"w{i % 97}" for i in range(600))  # a long shared system prompt: many full blocks
    async with running_server(MockFactory()) as serving:
        claude = anthropic.AsyncAnthropic(base_url=serving.url, api_key="k", max_retries=0)
        oai = openai.AsyncOpenAI(base_url=serving.url + "/v1", api_key="k", max_retries=0)

        async def messages_hit(salt: str | None) -> int:
            extra = {} if salt is None else {"cache_salt": salt}
            m = await claude.messages.create(model="mock-model", max_tokens=2, system=system, extra_body=extra,
                                             messages=[{"role": "user", "content": "hello"}])
            return m.usage.cache_read_input_tokens or 0

        async def responses_hit(salt: str | None) -> int:
            extra = {} if salt is None else {"cache_salt": salt}
            r = await oai.responses.create(model="mock-model", max_output_tokens=2, instructions=system + " r",
                                           input="hello", extra_body=extra)
            assert r.usage is not None
            return r.usage.input_tokens_details.cached_tokens

        for hit, a, b in ((messages_hit, "A", "B"), (responses_hit, "C", "D")):
            assert await hit(a) == 0
            assert await hit(a) > 500  # the same salt shares its own cache
            assert await hit(b) == 0  # another salt never hits its blocks
            assert await hit(b) > 500
        assert await messages_hit(None) == 0  # nor does an unsalted request
        assert await messages_hit(None) > 500


# ---- what /internal/kv-events reveals: block hashes only to an internal key (or an open server) ----

async def _kv_feed(url: str, key: str | None, prompt: list[int]) -> tuple[dict[str, Any], set[str]]:
    """The hello, and the block hashes stored while `prompt` runs (sent with `key`), as a subscriber sees them."""
    import trio
    import trio_websocket

    headers = [] if key is None else [(b"Authorization", f"Bearer {key}".encode())]
    stored: set[str] = set()
    async with trio_websocket.open_websocket_url(url.replace("http", "ws", 1) + "/internal/kv-events",
                                                 extra_headers=headers) as ws:
        hello = json.loads(await ws.get_message())
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            auth = {} if key is None else {"Authorization": f"Bearer {key}"}
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}, headers=auth)
            assert r.status_code == 200, r.text
        with trio.move_on_after(2):
            while True:
                msg = json.loads(await ws.get_message())
                for report in msg.get("reports", ()):
                    stored |= {e["block_hash"] for e in report["kv_events"] if e["kind"] == "stored"}
                if stored:
                    break
    return hello, stored


async def test_kv_events_reveal_block_hashes_only_to_an_internal_key() -> None:
    import trio_websocket

    from trillm.engine.block_manager import block_hashes, root_hash

    prompt = list(range(10, 10 + 8 * DEFAULT_BLOCK))

    def recomputed(model_id: str) -> set[str]:  # what an API user would compute for a guessed prompt
        return {h.hex() for h in block_hashes(root_hash(model_id), prompt, DEFAULT_BLOCK)}

    async with running_server(MockFactory(), api_key="user-key") as serving:
        hello, stored = await _kv_feed(serving.url, "user-key", prompt)
        assert hello["hash_seed"] is None and hello["model_id"]  # no seed for an API user...
        assert stored and not stored & recomputed(hello["model_id"])  # ...and no hash matches a guess
    async with running_server(MockFactory(), api_key="user-key", internal_api_key="router-key") as serving:
        try:
            await _kv_feed(serving.url, "user-key", prompt)
        except trio_websocket.ConnectionRejected as exc:
            assert exc.status_code == 401
        else:
            raise AssertionError("the API key must not open /internal/* when an internal key is set")
        hello, stored = await _kv_feed(serving.url, "router-key", prompt)  # the router: the API takes its key
        assert hello["hash_seed"] == root_hash(hello["model_id"]).hex()
        assert stored and stored <= recomputed(hello["model_id"])
