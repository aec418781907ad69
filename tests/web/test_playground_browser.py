"""The playground in a real browser (headless Chromium + Selenium) against live servers.

Most tests serve the mock engine (tests/web/conftest.py), whose output for a prompt and seed is known exactly
(the same request run offline); one serves `trillm serve --mock` from the command line and one the real
default model. Screenshots land in
results/playground/ (the path is printed); docs/playground.png is default-model.png from this file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel

from chromium import Page, find_chromium, start_chromium
from conftest import TOKENIZER, MockFactory, reference_text, running_server, scripted

LAST_ANSWER = "const m = document.querySelectorAll('.msg.assistant'); const a = m[m.length - 1];\n"
# The last answer's state, text and per-answer stats, in one round trip.
ANSWER_FIELDS = """const stats = {};
for (const s of a.querySelectorAll('.meta [data-stat]')) stats[s.dataset.stat] = s.dataset.value;
return {state: a.dataset.state, text: a.querySelector('.body').textContent, stats,
        status: (a.querySelector('.meta .status') || {}).textContent};"""
ANSWER = LAST_ANSWER + "if (!a) return null;\n" + ANSWER_FIELDS
# The same once it is finished in one of the states arguments[0].
FINISHED_ANSWER = (LAST_ANSWER + "if (!a || !arguments[0].includes(a.dataset.state) || !a.querySelector('.meta')) "
                   "return null;\n" + ANSWER_FIELDS)
PANEL = """const card = document.querySelector(`#stats [data-model="${arguments[0]}"]`);
if (!card) return null;
const out = {};
for (const dd of card.querySelectorAll('dd[data-stat]')) out[dd.dataset.stat] = dd.dataset.value;
return out;"""


def prompt_len(messages: list[dict[str, str]]) -> int:
    return len(TOKENIZER.apply_chat_template(messages))


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    found = find_chromium()
    if isinstance(found, str):
        pytest.skip(found)
    browser = start_chromium(*found, tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.quit()


@pytest.fixture
async def page(driver: Any) -> Any:
    page = Page(driver)
    yield page
    errors = await page.js_errors()
    await page.open("about:blank")  # closes the page's socket and stops its polling
    assert not errors, f"script errors in the page: {errors}"


async def open_playground(page: Page, url: str, **settings: str) -> None:
    await page.open(url + "/")
    await page.wait_for("return document.getElementById('conn').dataset.state === 'open'")
    for element_id, value in settings.items():
        await page.type(element_id, value)


async def ask(page: Page, text: str) -> None:
    await page.type("input", text + "\n")


async def answer_when(page: Page, states: tuple[str, ...] = ("done",), timeout: float = 10.0) -> dict[str, Any]:
    answer: dict[str, Any] = await page.wait_for(FINISHED_ANSWER, list(states), timeout=timeout)
    return answer


async def watch_stream(page: Page, model: str, timeout: float = 10.0) -> tuple[list[int], list[dict[str, Any]]]:
    """Poll the last answer until it is finished: the text lengths seen, and the panel as seen meanwhile."""
    lengths: list[int] = []
    panels: list[dict[str, Any]] = []
    with trio.fail_after(timeout):
        while True:
            answer, panel = await page.js(
                "return [(function(){" + ANSWER + "})(), (function(){" + PANEL + "}).apply(null, arguments)]", model)
            if answer is not None:
                lengths.append(len(answer["text"]))
                if panel:
                    panels.append(panel)
                if answer["state"] in ("done", "stopped", "error"):
                    return lengths, panels
            await trio.sleep(0.02)


async def test_streams_an_answer_token_by_token_with_its_stats(page: Page) -> None:
    async with running_server(MockFactory(step_delay=0.02)) as serving:
        await open_playground(page, serving.url, temperature="0", max_tokens="60")
        assert await page.js("return [...document.querySelectorAll('#model option')].map(o => o.value)") == [
            "mock-model"]
        await page.wait_for(PANEL, "mock-model")
        await ask(page, "hello there")
        lengths, panels = await watch_stream(page, "mock-model")
        answer = await answer_when(page)
        await page.screenshot("streamed-answer")
        prompt = TOKENIZER.apply_chat_template([{"role": "user", "content": "hello there"}])
        assert answer["text"] == reference_text(prompt, 60)
        growing = sorted(set(lengths))
        assert len(growing) >= 8 and lengths == sorted(lengths), lengths  # grew step by step, never shrank
        assert answer["status"] == "done (length)"
        stats = answer["stats"]
        assert int(stats["prompt_tokens"]) == len(prompt) and int(stats["completion_tokens"]) == 60
        assert int(stats["cached_tokens"]) == 0
        assert 0 < float(stats["ttft_ms"]) < 5000 and 0 < float(stats["tokens_per_s"]) < 1000
        # The live panel saw the request running (with KV blocks), then saw it finish.
        assert any(p["running"] == "1" and int(p["kv_blocks_used"]) > 0 for p in panels), panels
        done = await page.wait_for(PANEL.replace("return out;", "return out.requests === '1' ? out : null;"),
                                   "mock-model")
        assert done["running"] == "0" and done["kv_blocks_used"] == "0"


async def test_stop_cancels_mid_answer_and_the_conversation_goes_on(page: Page) -> None:
    async with running_server(MockFactory(step_delay=0.02)) as serving:
        service = serving.services[0]
        await open_playground(page, serving.url, temperature="0", max_tokens="2000")
        await ask(page, "count to a thousand")
        await page.wait_for(LAST_ANSWER + "return a && a.querySelector('.body').textContent.length >= 12")
        await page.click("stop")
        answer = await answer_when(page, ("stopped",))
        await page.screenshot("stopped-answer")
        assert answer["status"] == "stopped"
        first = [{"role": "user", "content": "count to a thousand"}]
        partial = answer["text"]
        assert 12 <= len(partial) < 2000
        assert reference_text(TOKENIZER.apply_chat_template(first), 2000).startswith(partial)
        with trio.fail_after(2):  # the server has nothing left running
            while service.statistics().num_live_requests:
                await trio.sleep(0.02)
        assert service.metrics.outcomes["abort"] == 1
        await trio.sleep(0.2)
        assert (await answer_when(page, ("stopped",)))["text"] == partial  # and nothing more arrived
        assert await page.js("return document.getElementById('send').disabled") is False
        # The next request carries the conversation, the stopped answer included.
        await page.type("max_tokens", "5")
        await ask(page, "go on")
        answer = await answer_when(page)
        history = [*first, {"role": "assistant", "content": partial}, {"role": "user", "content": "go on"}]
        assert int(answer["stats"]["prompt_tokens"]) == prompt_len(history)
        assert int(answer["stats"]["completion_tokens"]) == 5
        # "New conversation" during an answer cancels it and forgets everything before.
        await page.type("max_tokens", "2000")
        await ask(page, "once more")
        await page.wait_for(LAST_ANSWER + "return a && a.querySelector('.body').textContent.length >= 5")
        await page.click("clear")
        assert await page.js("return document.getElementById('log').children.length") == 0
        with trio.fail_after(2):
            while service.statistics().num_live_requests:
                await trio.sleep(0.02)
        await page.type("max_tokens", "3")
        await ask(page, "fresh")
        answer = await answer_when(page)
        assert int(answer["stats"]["prompt_tokens"]) == prompt_len([{"role": "user", "content": "fresh"}])


async def test_settings_reach_the_server(page: Page) -> None:
    async with running_server(MockFactory()) as serving:
        await open_playground(page, serving.url, system="Be brief.", temperature="1", top_p="0.9", seed="7",
                              max_tokens="40")
        await ask(page, "say anything")
        answer = await answer_when(page)
        system = {"role": "system", "content": "Be brief."}
        first = [system, {"role": "user", "content": "say anything"}]
        assert answer["text"] == reference_text(TOKENIZER.apply_chat_template(first), 40, seed=7)
        assert int(answer["stats"]["prompt_tokens"]) == prompt_len(first)
        # A stop string ends the answer where it first appears (and is trimmed); a new conversation starts empty.
        again = TOKENIZER.apply_chat_template([system, {"role": "user", "content": "again"}])
        expected = reference_text(again, 40, seed=7)
        words = expected.split(" ")
        stop = next(f"{w} " for i, w in enumerate(words) if i >= 5 and w not in words[:i])  # spans two tokens
        await page.click("clear")
        assert await page.js("return document.getElementById('log').children.length") == 0
        await page.type("stop_strings", stop)
        await ask(page, "again")
        answer = await answer_when(page)
        assert answer["text"] == expected[: expected.index(stop)] and answer["status"] == "done (stop)"
        assert int(answer["stats"]["prompt_tokens"]) == prompt_len([system, {"role": "user", "content": "again"}])
        # A value the server refuses comes back as that answer's error; the page stays usable.
        await page.type("top_p", "5")
        await ask(page, "with a bad top_p")
        answer = await answer_when(page, ("error",))
        assert "top_p" in answer["status"]
        await page.type("top_p", "1")
        await ask(page, "fine again")
        assert (await answer_when(page))["state"] == "done"


async def test_api_key_is_asked_for_and_sent_over_the_websocket(page: Page) -> None:
    key = "s3cret/+key=="  # not a valid subprotocol token as is: the page must encode it
    async with running_server(MockFactory(), api_key=key) as serving:
        await page.open(serving.url + "/")
        await page.wait_for("return !document.getElementById('keybar').hidden")
        assert await page.js("return document.querySelectorAll('#model option').length") == 0
        await page.type("apikey", "wrong\n")
        await page.wait_for("return document.getElementById('keyerror').textContent.includes('refused')")
        await page.screenshot("api-key-asked")
        await page.type("apikey", key + "\n")
        await page.wait_for("return document.getElementById('conn').dataset.state === 'open'")
        assert await page.js("return document.getElementById('keybar').hidden") is True
        await page.type("max_tokens", "5")
        await ask(page, "hi")
        assert int((await answer_when(page))["stats"]["completion_tokens"]) == 5
        # The key is kept for the tab's session: a reload connects without asking again.
        await page.open(serving.url + "/")
        await page.wait_for("return document.getElementById('conn').dataset.state === 'open'")
        assert await page.js("return document.getElementById('keybar').hidden") is True


INJECTION = ('Look: <img src=x onerror="window.pwned=1"><b>bold</b> <script>window.pwned=2</script> '
             "and `a<b>c`\n```html\n<script>window.pwned=3</script>\n<i>x</i>\n```\nthe end")


async def test_html_in_messages_is_shown_as_text_and_code_blocks_as_code(page: Page) -> None:
    question = '<img src=y onerror="window.pwned=4"> hello'
    async with running_server(scripted([{"role": "user", "content": question}], INJECTION)) as serving:
        await open_playground(page, serving.url)
        await ask(page, question)
        answer = await answer_when(page)
        await page.screenshot("html-as-text")
        assert await page.js("return document.querySelectorAll('#log img, #log script, #log b, #log i').length") == 0
        assert await page.js("return window.pwned === undefined") is True
        assert await page.js("return document.querySelector('.msg.user .body').textContent") == (
            '<img src=y onerror="window.pwned=4"> hello')
        code = await page.js("const pre = document.querySelector('.msg.assistant pre');"
                             "return [pre.dataset.lang, pre.querySelector('code').textContent]")
        assert code == ["html", "<script>window.pwned=3</script>\n<i>x</i>"]
        assert await page.js("return document.querySelector('.msg.assistant .text code').textContent") == "a<b>c"
        assert answer["text"].startswith('Look: <img src=x onerror="window.pwned=1"><b>bold</b> <script>')
        assert answer["text"].endswith("the end")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_works_with_trillm_serve_mock(page: Page) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    trillm = Path(sys.executable).with_name("trillm")
    proc = subprocess.Popen([str(trillm), "serve", "--mock", "--port", str(port), "--log-level", "warning"],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert proc.poll() is None, "trillm serve --mock exited"
                    await trio.sleep(0.1)
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            await open_playground(page, url, max_tokens="300")
            await page.wait_for(PANEL, model)
            long_message = "Tell me a long story about a paged KV cache and a trio nursery. " * 4
            await ask(page, long_message)
            lengths, panels = await watch_stream(page, model)
            first = await answer_when(page)
            assert len(set(lengths)) >= 8 and int(first["stats"]["completion_tokens"]) == 300
            assert any(int(p.get("kv_blocks_used") or 0) > 0 for p in panels), panels
            # The same prompt again, in a new conversation, is served from the prefix cache.
            await page.click("clear")
            await page.type("max_tokens", "20")
            await ask(page, long_message)
            second = await answer_when(page)
            assert int(second["stats"]["prompt_tokens"]) == int(first["stats"]["prompt_tokens"])
            assert int(second["stats"]["cached_tokens"]) > 0
            panel = await page.wait_for(PANEL.replace("return out;", "return out.requests === '2' ? out : null;"),
                                        model)
            assert float(panel["prefix_cache_hit_rate"]) > 0
            await page.screenshot("mock-engine")
            metrics = (await client.get("/metrics")).text
            assert f'trillm_num_requests_running{{model="{model}"}} 0.0' in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow
async def test_works_with_the_default_model(page: Page, default_model: LoadedModel) -> None:
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=256)
    async with running_server(lambda: LLMEngine(config, loaded=default_model)) as serving:
        name = serving.services[0].model_name
        await open_playground(page, serving.url, system="You are a helpful assistant.", temperature="0",
                              max_tokens="24")
        await ask(page, "What is the capital of France?")
        answer = await answer_when(page, timeout=60)
        assert "Paris" in answer["text"], answer
        await page.type("max_tokens", "90")
        await ask(page, "Write a Python function that returns the square of a number.")
        lengths, _ = await watch_stream(page, name, timeout=60)
        answer = await answer_when(page)
        assert len(set(lengths)) >= 5 and answer["state"] == "done"
        await page.wait_for(PANEL.replace("return out;", "return out.requests === '2' ? out : null;"), name)
        await page.js("document.getElementById('log').scrollTop = 0")
        await page.screenshot("default-model")
