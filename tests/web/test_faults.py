"""Fault injection against a live server: the engine raising mid-step, during prefill and during load; one
request's detokenizer raising; ids past the vocabulary; dead engines' gauges; start-up refusals."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import trio

from trillm.engine.errors import ModelNotFound
from trillm.engine.llm_engine import LLMEngine, REQUEST_FAILED
from trillm.engine.mock import MockModelSpec, MockTokenizer, Recording
from trillm.web.config import ServeError, ServerConfig
from trillm.web.server import ModelSpec, serve
from trillm.web.service.engine_service import ServiceState

from conftest import SPEC, TOKENIZER, ByteTokenizer, MockFactory, parse_sse, running_server

POISON = 7


class PoisonedTokenizer(MockTokenizer):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if POISON in ids:
            raise RuntimeError("decoder exploded")
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


class FlakyLoad:
    """A model that cannot be loaded while `broken` (a missing file, say); counts the attempts."""

    def __init__(self, factory: MockFactory) -> None:
        self.factory = factory
        self.broken = True
        self.attempts = 0

    def __call__(self) -> LLMEngine:
        self.attempts += 1
        if self.broken:
            raise ModelNotFound("no model at /secret/path")
        return self.factory()


async def stream(client: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/completions") -> list[Any]:
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return parse_sse(r.content)


def text_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))


async def test_one_requests_detokenizer_raising_fails_only_it() -> None:
    factory = MockFactory(tokenizer=PoisonedTokenizer(SPEC.vocab_size), step_delay=0.002)
    async with running_server(factory) as serving, httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
        results: dict[str, list[Any]] = {}

        async def one(name: str, prompt: list[int]) -> None:
            results[name] = await stream(client, {"prompt": prompt, "max_tokens": 40, "ignore_eos": True})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "good", [10, 11, 12])
            await trio.sleep(0.02)
            nursery.start_soon(one, "bad", [10, POISON, 12])
        bad, good = results["bad"], results["good"]
        assert bad[-1] == "[DONE]" and bad[-2]["error"]["message"] == REQUEST_FAILED
        assert "exploded" not in json.dumps(bad)
        assert good[-1] == "[DONE]" and good[-2]["choices"][0]["finish_reason"] == "length"
        assert len(TOKENIZER.encode(text_of(good))) == 40
        health = (await client.get("/health")).json()
        assert health["status"] == "ok" and len(factory.engines) == 1
        assert serving.services[0].num_restarts == 0 and serving.services[0].statistics().engine.num_blocks_used == 0


async def test_engine_raising_during_prefill_fails_everyone_then_restarts() -> None:
    factory = MockFactory(step_delay=0.003)
    async with running_server(factory, service_config={"restart_backoff_s": 0.05}) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            events: dict[int, list[Any]] = {}

            async def one(i: int) -> None:
                events[i] = await stream(client, {"prompt": f"w{i}", "max_tokens": 300, "ignore_eos": True})

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
                with trio.fail_after(5):
                    while factory.engines[0].statistics().num_running < 3:
                        await trio.sleep(0.005)
                launch = factory.engine.runner.launch

                def launch_failing_on_prefill(batch: Any, *args: Any, **kwargs: Any) -> Any:
                    if batch.prefills:
                        raise RuntimeError("prefill blew up")
                    return launch(batch, *args, **kwargs)

                factory.engine.runner.launch = launch_failing_on_prefill  # type: ignore[method-assign]
                nursery.start_soon(one, 3)  # its prefill is what fails
            for i in range(4):
                assert events[i][-1] == "[DONE]" and "the engine failed" in events[i][-2]["error"]["message"]
                assert "blew up" not in json.dumps(events[i])
            with trio.fail_after(5):
                while (await client.get("/health")).status_code != 200:
                    await trio.sleep(0.02)
            ok = await stream(client, {"prompt": "after", "max_tokens": 5})
            assert ok[-2]["choices"][0]["finish_reason"] == "length" and len(factory.engines) == 2


async def test_a_model_that_cannot_be_loaded_lazily_is_a_clear_503_and_retried_after_a_backoff() -> None:
    flaky = FlakyLoad(MockFactory())
    service_config = {"lazy_load": True, "restart_backoff_s": 0.4, "max_restart_backoff_s": 0.8}
    async with running_server(flaky, service_config=service_config) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            body = {"prompt": "a", "max_tokens": 2}
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json=body)  # loads, fails: the answer says so at once
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
            assert "could not be loaded" in r.json()["error"]["message"] and "secret" not in r.text
            assert int(r.headers["Retry-After"]) >= 1
            health = await client.get("/health")
            model = health.json()["models"][serving.services[0].model_name]
            assert health.status_code == 503 and model["state"] == "load_failed"
            assert "could not be loaded" in model["error"] and model["next_load_in_s"] > 0
            for _ in range(5):  # within the backoff: refused at once, no new attempt
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
            assert flaky.attempts == 1 and time.perf_counter() - t0 < 0.4
            await trio.sleep(0.45)
            r = await client.post("/v1/completions", json=body)  # past the backoff: tried again, fails again
            assert r.status_code == 503 and flaky.attempts == 2
            assert serving.services[0].next_load_in_s > 0.5  # the backoff doubled
            flaky.broken = False
            await trio.sleep(0.85)
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200 and flaky.attempts == 3
            assert (await client.get("/health")).json()["status"] == "ok"


async def test_a_reload_that_fails_after_an_engine_failure_is_retried_on_its_own() -> None:
    flaky = FlakyLoad(MockFactory(step_delay=0.002))
    flaky.broken = False
    service_config = {"restart_backoff_s": 0.05, "max_restart_backoff_s": 0.1}
    async with running_server(flaky, service_config=service_config) as serving:
        service = serving.services[0]
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            flaky.broken = True
            flaky.factory.fail_next_step()
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
            with trio.fail_after(5):
                while service.state is not ServiceState.LOAD_FAILED:
                    await trio.sleep(0.005)
            metrics = (await client.get("/metrics")).text
            assert "trillm_kv_blocks_used{" not in metrics  # the dead engine's gauges are gone
            assert 'trillm_model_healthy{model="mock-model"} 0' in metrics
            with trio.fail_after(5):
                while flaky.attempts < 4:  # not lazy: retried with backoff, no request needed
                    await trio.sleep(0.01)
            flaky.broken = False
            with trio.fail_after(5):
                while service.state is not ServiceState.READY:
                    await trio.sleep(0.01)
            r = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 3})
            assert r.status_code == 200


async def test_metrics_drop_an_unloaded_engines_gauges() -> None:
    async with running_server(MockFactory(), service_config={"unload_after_idle_s": 0.1}) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
            assert (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})).status_code == 200
            assert "trillm_kv_blocks_total{" in (await client.get("/metrics")).text
            with trio.fail_after(5):
                while serving.services[0].state is not ServiceState.UNLOADED:
                    await trio.sleep(0.02)
            metrics = (await client.get("/metrics")).text
            assert "trillm_kv_blocks_total{" not in metrics and "trillm_num_requests_running{" not in metrics
            assert 'trillm_model_healthy{model="mock-model"} 1' in metrics  # unloaded on purpose is healthy
            stats = (await client.get("/stats")).json()["models"][0]
            assert stats["state"] == "unloaded" and stats["engine"] is None


async def test_ids_past_the_vocabulary_never_drop_the_stream() -> None:
    tok = ByteTokenizer()
    spec = MockModelSpec(name="mock-model", vocab_size=tok.vocab_size, max_model_len=2048)
    messages = [{"role": "user", "content": "x"}]
    # A padded-vocabulary model: ids 259 and up have weights but no token.
    output = tok.encode("ab") + [tok.vocab_size + 5, tok.vocab_size + 100] + tok.encode("c")
    recording = Recording([(tok.encode("hi"), output), (tok.apply_chat_template(messages), output)])
    factory = MockFactory(spec=spec, recording=recording, tokenizer=tok)
    async with running_server(factory) as serving, httpx.AsyncClient(base_url=serving.url, timeout=30) as client:
        completion = {"prompt": tok.encode("hi"), "max_tokens": 5, "logprobs": 2}
        events = await stream(client, completion)
        assert events[-1] == "[DONE]" and text_of(events) == "abc"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        r = await client.post("/v1/completions", json=completion)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
        chat = {"messages": messages, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
        events = await stream(client, chat, "/v1/chat/completions")
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        content = [lp for e in events[:-1] for c in e["choices"] for lp in (c["logprobs"] or {}).get("content", [])]
        assert [lp["bytes"] for lp in content] == [[97], [98], [], [], [99]]
        assert len(factory.engines) == 1


async def test_duplicate_served_names_are_refused_before_loading() -> None:
    factory = MockFactory()
    with pytest.raises(ServeError, match="two models are served under the name 'a'"):
        await serve([ModelSpec("a", factory), ModelSpec("a", factory)], ServerConfig(port=0))
    assert factory.engines == []
    # The models' own names, once loaded:
    with pytest.RaisesGroup(pytest.RaisesExc(ServeError, match="'mock-model'"), flatten_subgroups=True):
        await serve([ModelSpec(None, factory), ModelSpec(None, MockFactory())], ServerConfig(port=0))


async def test_a_busy_port_is_one_clear_error_before_loading() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        factory = MockFactory()
        with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            await serve([ModelSpec(None, factory)], ServerConfig(port=port))
        assert factory.engines == []
        proc = await trio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "trillm.web.cli", "serve", "--mock", "--port", str(port)],
            capture_output=True, text=True, timeout=60))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"trillm serve: cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr.splitlines()


async def test_a_connection_whose_first_request_comes_late_is_answered() -> None:
    """A fresh connection is idle to hypercorn until its first request: with a keep-alive timeout as short as
    the clients' own (httpx keeps idle connections 5 s), a loaded client's late request met a closed socket."""
    wait = httpx.Limits().keepalive_expiry or 5.0
    assert ServerConfig().keep_alive_timeout_s > wait + 5  # longer than the clients' idle expiry, with margin
    async with running_server(MockFactory()) as serving:
        host, port = serving.url.removeprefix("http://").rsplit(":", 1)
        stream_ = await trio.open_tcp_stream(host, int(port))
        async with stream_:
            await trio.sleep(wait + 0.5)
            await stream_.send_all(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            with trio.fail_after(5):
                data = b""
                while chunk := await stream_.receive_some(65536):
                    data += chunk
        assert data.startswith(b"HTTP/1.1 200")



def test_readme_lists_every_limit_flag_with_its_default() -> None:
    import argparse
    import re
    from pathlib import Path

    from trillm.web.cli import serve as cli_serve

    parser = argparse.ArgumentParser()
    cli_serve.configure(parser)
    help_text = parser.format_help()
    section = help_text.split("limits on one request", 1)[1].split("\n\n", 1)[0]
    flags = sorted(set(re.findall(r"^  (--[a-z-]+)", section, re.M))) + [
        "--drain-timeout", "--keep-alive-timeout", "--max-waiting", "--memory-limit"]
    assert len(flags) > 12
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = {ln.split("|")[1]: ln for ln in readme.splitlines() if ln.startswith("| `--")}
    for flag in flags:
        row = next((r for cell, r in rows.items() if f"`{flag}`" in cell), None)
        assert row is not None, f"README's limits table lacks {flag}"
        default = parser.get_default(flag[2:].replace("-", "_"))
        shown = "none" if default is None else f"{default:g}" if isinstance(default, float) else str(default)
        assert shown in row, (flag, default, row)
