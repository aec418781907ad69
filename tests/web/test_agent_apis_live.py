"""Anthropic's Messages API and OpenAI's Responses API on a live server, through the official `anthropic` and
`openai` SDKs (unchanged) and as raw SSE: the mock engine for speed, the default model for "it works"."""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
import trio
from pydantic import BaseModel

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel

from conftest import TOKENIZER, MockFactory, reference_text, running_server, scripted

MESSAGES = [{"role": "user", "content": "Hello there"}]
CHAT_IDS = TOKENIZER.apply_chat_template(MESSAGES)
GREEDY = {"temperature": 0}  # current SDKs have no temperature parameter; older clients send it in the body
LONG = [{"role": "user", "content": " ".join(f"word{i}" for i in range(60))}]


def anthropic_client(url: str, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, max_retries=0, **{"api_key": "k", "timeout": 20, **kw})


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)


def parse_named_sse(data: bytes) -> list[tuple[str | None, Any]]:
    """(event name, JSON data) of each event of an SSE body; comments (keepalives) are skipped."""
    events = []
    for block in data.decode().split("\n\n"):
        name, payload = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                payload = json.loads(line[len("data: "):])
        if payload is not None:
            events.append((name, payload))
    return events


# ---- Messages API: the anthropic SDK ----

def messages_calls(url: str) -> dict[str, Any]:
    client = anthropic_client(url)
    out: dict[str, Any] = {}
    out["create"] = client.messages.create(model="mock-model", max_tokens=7, messages=MESSAGES, extra_body=GREEDY)
    with client.messages.stream(model="mock-model", max_tokens=7, messages=MESSAGES, extra_body=GREEDY) as stream:
        out["text_stream"] = list(stream.text_stream)
        out["final"] = stream.get_final_message()
    out["count"] = client.messages.count_tokens(model="mock-model", messages=MESSAGES)
    words = out["create"].content[0].text.split(" ")
    out["stop_word"] = " " + words[3]
    out["stopped"] = client.messages.create(model="mock-model", max_tokens=7, messages=MESSAGES,
                                            stop_sequences=["zzz-never", out["stop_word"]], extra_body=GREEDY)
    out["long"] = [client.messages.create(model="mock-model", max_tokens=2, messages=LONG, system="sys",
                                          extra_body=GREEDY) for _ in range(2)]
    out["long_count"] = client.messages.count_tokens(model="mock-model", messages=LONG, system="sys")
    out["alias"] = client.messages.create(model="claude-sonnet-4-5", max_tokens=3, messages=MESSAGES)
    out["models"] = [m.id for m in client.models.list()]
    for key, call in {
        "unknown_model": lambda: client.messages.create(model="gpt-9", max_tokens=3, messages=MESSAGES),
        "image": lambda: client.messages.create(model="mock-model", max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
        "bad": lambda: client.messages.create(model="mock-model", max_tokens=0, messages=MESSAGES),
    }.items():
        try:
            call()
        except anthropic.APIStatusError as exc:
            out[key] = exc
    return out


async def test_anthropic_sdk_create_stream_stop_sequences_count_tokens() -> None:
    async with running_server(MockFactory(step_delay=0.001), model_aliases=(("claude-*", "mock-model"),)) as serving:
        out = await trio.to_thread.run_sync(messages_calls, serving.url)
    want = reference_text(CHAT_IDS, 7)
    create = out["create"]
    assert create.content[0].type == "text" and create.content[0].text == want
    assert create.id.startswith("msg_") and create.role == "assistant" and create.model == "mock-model"
    assert create.stop_reason == "max_tokens" and create.stop_sequence is None
    assert (create.usage.input_tokens, create.usage.output_tokens) == (len(CHAT_IDS), 7)
    assert "".join(out["text_stream"]) == want and out["final"].content[0].text == want
    assert out["final"].usage.output_tokens == 7 and out["final"].stop_reason == "max_tokens"
    assert out["count"].input_tokens == create.usage.input_tokens
    stopped = out["stopped"]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == out["stop_word"]
    assert stopped.content[0].text == want[: want.index(out["stop_word"])]
    first, second = out["long"]
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == out["long_count"].input_tokens
    # The second time the prefix cache serves the prompt's full blocks; the three parts add up to the prompt.
    assert second.usage.cache_read_input_tokens > 0
    assert (second.usage.input_tokens + second.usage.cache_read_input_tokens
            + second.usage.cache_creation_input_tokens) == out["long_count"].input_tokens
    assert out["alias"].model == "mock-model" and out["alias"].content
    assert out["models"] == ["mock-model"]
    assert isinstance(out["unknown_model"], anthropic.NotFoundError)
    assert out["unknown_model"].body["error"]["type"] == "not_found_error"
    assert isinstance(out["image"], anthropic.BadRequestError) and "text only" in str(out["image"])
    assert isinstance(out["bad"], anthropic.BadRequestError) and "max_tokens" in str(out["bad"])
    assert out["bad"].body == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": out["bad"].body["error"]["message"]}}


def auth_calls(url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["x_api_key"] = anthropic_client(url, api_key="sekrit").messages.create(
        model="mock-model", max_tokens=2, messages=MESSAGES)
    out["bearer"] = anthropic_client(url, api_key=None, auth_token="sekrit").messages.create(
        model="mock-model", max_tokens=2, messages=MESSAGES)
    try:
        anthropic_client(url, api_key="wrong").messages.create(model="mock-model", max_tokens=2, messages=MESSAGES)
    except anthropic.APIStatusError as exc:
        out["wrong"] = exc
    return out


async def test_anthropic_auth_by_x_api_key_or_bearer() -> None:
    async with running_server(MockFactory(), api_key="sekrit") as serving:
        out = await trio.to_thread.run_sync(auth_calls, serving.url)
        async with httpx.AsyncClient(base_url=serving.url) as client:
            versioned = await client.post("/v1/messages?beta=true", json={
                "model": "mock-model", "max_tokens": 2, "messages": MESSAGES},
                headers={"x-api-key": "sekrit", "anthropic-version": "2023-06-01",
                         "anthropic-beta": "interleaved-thinking-2025-05-14"})
            openai_side = await client.get("/v1/models", headers={"x-api-key": "wrong"})
    assert out["x_api_key"].content and out["bearer"].content
    assert isinstance(out["wrong"], anthropic.AuthenticationError)
    assert out["wrong"].body["error"]["type"] == "authentication_error"
    assert versioned.status_code == 200 and versioned.json()["type"] == "message"
    assert openai_side.status_code == 401 and openai_side.json()["error"]["code"] == "invalid_api_key"


def overloaded_calls(url: str) -> Any:
    try:
        anthropic_client(url).messages.create(model="mock-model", max_tokens=2, messages=MESSAGES)
    except anthropic.APIStatusError as exc:
        return exc
    return None


async def test_full_queue_is_529_overloaded() -> None:
    config = EngineConfig(num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=64, max_waiting=0)
    async with running_server(MockFactory(config=config)) as serving:
        exc = await trio.to_thread.run_sync(overloaded_calls, serving.url)
        async with httpx.AsyncClient(base_url=serving.url) as client:
            chat = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert isinstance(exc, anthropic.OverloadedError) and exc.status_code == 529
    assert exc.body["error"]["type"] == "overloaded_error"
    assert chat.status_code == 503  # OpenAI's endpoints keep their own code


# ---- Messages API: raw SSE ----

async def test_messages_raw_sse_order_pings_and_mid_stream_error() -> None:
    factory = MockFactory(step_delay=0.03)
    async with running_server(factory, sse_keepalive_s=0.01) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=20) as client:
            r = await client.post("/v1/messages", json={"model": "mock-model", "max_tokens": 6, "stream": True,
                                                        "messages": MESSAGES, "temperature": 0})
            events = parse_named_sse(r.content)
            async with client.stream("POST", "/v1/messages", json={
                    "model": "mock-model", "max_tokens": 200, "stream": True, "messages": MESSAGES}) as failing:
                raw = b""
                async for chunk in failing.aiter_bytes():
                    raw += chunk
                    if b"content_block_delta" in raw and not factory.engine.runner.launch.__name__ == "broken":
                        factory.fail_next_step()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events if name != "ping"]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * len(names[2:-3]),
                     "content_block_stop", "message_delta", "message_stop"]
    assert "ping" in [name for name, _ in events]  # between steps, nothing else to say
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == reference_text(CHAT_IDS, 6)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == len(CHAT_IDS)
    delta = [d for n, d in events if n == "message_delta"][0]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 6
    failed = parse_named_sse(raw)
    assert failed[0][0] == "message_start" and failed[-1][0] == "error"
    assert failed[-1][1]["type"] == "error" and failed[-1][1]["error"]["type"] == "api_error"
    assert "message_stop" not in [n for n, _ in failed]


# ---- Responses API: the openai SDK and raw SSE ----

def responses_calls(url: str) -> dict[str, Any]:
    client = openai_client(url)
    out: dict[str, Any] = {}
    out["create"] = client.responses.create(model="mock-model", input="Hello there", max_output_tokens=7,
                                            temperature=0)
    out["events"] = list(client.responses.create(model="mock-model", input="Hello there", max_output_tokens=7,
                                                 temperature=0, stream=True))
    try:
        client.responses.create(model="mock-model", input="Hello there", store=True)
    except openai.BadRequestError as exc:
        out["store"] = exc
    try:
        client.responses.create(model="mock-model", input="Hi", tools=[{"type": "web_search"}])
    except openai.BadRequestError as exc:
        out["web_search"] = exc
    return out


async def test_openai_sdk_responses_streamed_and_not() -> None:
    async with running_server(MockFactory(step_delay=0.001)) as serving:
        out = await trio.to_thread.run_sync(responses_calls, serving.url)
    ids = TOKENIZER.apply_chat_template([{"role": "user", "content": "Hello there"}])
    want = reference_text(ids, 7)
    create = out["create"]
    assert create.output_text == want and create.id.startswith("resp_") and create.model == "mock-model"
    assert create.status == "incomplete" and create.incomplete_details.reason == "max_output_tokens"
    assert create.usage.input_tokens == len(ids) and create.usage.output_tokens == 7 and create.store is False
    events = out["events"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want
    assert "stateless" in str(out["store"]) and "stateless" in str(out["web_search"])


def completed_calls(url: str) -> dict[str, Any]:
    client = openai_client(url)
    with client.responses.stream(model="mock-model", input="Hello") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    return {"deltas": deltas, "final": final,
            "create": client.responses.create(model="mock-model", input=[{"role": "user", "content": "Hello"}])}


async def test_openai_sdk_responses_stream_helper_completes() -> None:
    async with running_server(scripted([{"role": "user", "content": "Hello"}], "Hi! How can I help?")) as serving:
        out = await trio.to_thread.run_sync(completed_calls, serving.url)
    assert "".join(out["deltas"]) == "Hi! How can I help?"
    assert out["final"].status == "completed" and out["final"].output_text == "Hi! How can I help?"
    assert out["create"].status == "completed" and out["create"].output_text == "Hi! How can I help?"
    message = out["create"].output[0]
    assert message.type == "message" and message.status == "completed" and message.content[0].type == "output_text"


def agent_sized_calls(url: str) -> dict[str, Any]:
    hello: Any = [{"role": "user", "content": "Hello"}]
    return {
        "message": anthropic_client(url).messages.create(model="mock-model", max_tokens=32000, messages=hello),
        "response": openai_client(url).responses.create(model="mock-model", input="Hello",
                                                        max_output_tokens=1_000_000),
    }


async def test_max_tokens_beyond_the_context_is_an_upper_bound() -> None:
    """Claude Code asks for 32000 tokens whatever the model: that fits by being lowered, never a 400."""
    async with running_server(scripted([{"role": "user", "content": "Hello"}], "Hi there")) as serving:
        out = await trio.to_thread.run_sync(agent_sized_calls, serving.url)
    assert out["message"].stop_reason == "end_turn" and out["message"].content[0].text == "Hi there"
    assert out["response"].status == "completed" and out["response"].output_text == "Hi there"


async def test_responses_raw_sse_names_sequence_numbers_and_failure() -> None:
    factory = MockFactory(step_delay=0.02)
    async with running_server(factory) as serving:
        async with httpx.AsyncClient(base_url=serving.url, timeout=20) as client:
            r = await client.post("/v1/responses", json={"model": "mock-model", "input": "Hello there", "stream": True,
                                                         "max_output_tokens": 4})
            async with client.stream("POST", "/v1/responses", json={
                    "model": "mock-model", "input": "Hello there", "stream": True}) as failing:
                raw = b""
                async for chunk in failing.aiter_bytes():
                    raw += chunk
                    if b"output_text.delta" in raw and not factory.engine.runner.launch.__name__ == "broken":
                        factory.fail_next_step()
    events = parse_named_sse(r.content)
    assert all(name == data["type"] for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 4, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.incomplete"]
    item_id = events[2][1]["item"]["id"]
    assert all(d["item_id"] == item_id for n, d in events[3:-2]) and events[-2][1]["item"]["id"] == item_id
    failed = parse_named_sse(raw)
    assert [d["sequence_number"] for _, d in failed] == list(range(len(failed)))
    kinds = [n for n, _ in failed]
    assert kinds[-1] == "response.failed" and "error" in kinds and "response.completed" not in kinds
    assert failed[-1][1]["response"]["status"] == "failed"


async def test_responses_errors_in_openai_shape() -> None:
    async with running_server(MockFactory()) as serving:
        async with httpx.AsyncClient(base_url=serving.url) as client:
            stateful = await client.post("/v1/responses", json={"model": "mock-model", "input": "x",
                                                                "previous_response_id": "resp_1"})
            unknown = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
    assert stateful.status_code == 400 and "stateless" in stateful.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


# ---- the default model ----

def default_model_calls(url: str, name: str) -> dict[str, Any]:
    client = anthropic_client(url)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out: dict[str, Any] = {}
    out["create"] = client.messages.create(model=name, max_tokens=16, messages=question, extra_body=GREEDY,
                                           system="You are a helpful assistant.")
    with client.messages.stream(model=name, max_tokens=16, messages=question, extra_body=GREEDY,
                                system="You are a helpful assistant.") as stream:
        out["text_stream"] = "".join(stream.text_stream)
        out["final"] = stream.get_final_message()
    out["count"] = client.messages.count_tokens(model=name, messages=question, system="You are a helpful assistant.")
    responses = openai_client(url).responses
    out["response"] = responses.create(model=name, input="What is the capital of France?", max_output_tokens=16,
                                       temperature=0, instructions="You are a helpful assistant.")
    out["response_events"] = list(responses.create(model=name, input="What is the capital of France?",
                                                   max_output_tokens=16, temperature=0, stream=True,
                                                   instructions="You are a helpful assistant."))
    return out


@pytest.mark.slow
async def test_both_apis_work_on_the_default_model(default_model: LoadedModel) -> None:
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=256)
    async with running_server(lambda: LLMEngine(config, loaded=default_model)) as serving:
        name = serving.services[0].model_name
        out = await trio.to_thread.run_sync(default_model_calls, serving.url, name)
    text = out["create"].content[0].text
    assert "Paris" in text
    assert out["text_stream"] == text and out["final"].content[0].text == text
    assert out["count"].input_tokens == out["create"].usage.input_tokens + out["create"].usage.cache_read_input_tokens
    assert out["response"].output_text == text  # the same prompt and greedy decoding through the other API
    assert "".join(e.delta for e in out["response_events"] if e.type == "response.output_text.delta") == text



# ---- tools and structured output on the default model ----

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


class City(BaseModel):
    # Anthropic's SDK moves length and range limits into descriptions (its structured outputs do not enforce
    # them), so the fields are ones a small model cannot run away with.
    name: str
    is_capital: bool
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


def anthropic_agent_calls(url: str, name: str) -> dict[str, Any]:
    client = anthropic_client(url, timeout=120)
    tools: Any = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}]
    ask: Any = [{"role": "user", "content": ASK}]
    forced: Any = {"type": "tool", "name": "get_weather"}
    out: dict[str, Any] = {}
    out["forced"] = client.messages.create(model=name, max_tokens=64, messages=ask, tools=tools, tool_choice=forced,
                                           extra_body=GREEDY)
    with client.messages.stream(model=name, max_tokens=64, messages=ask, tools=tools, tool_choice=forced,
                                extra_body=GREEDY) as stream:
        out["stream_events"] = [e.type for e in stream]
        out["streamed"] = stream.get_final_message()
    use = next(b for b in out["forced"].content if b.type == "tool_use")
    follow_up: Any = [*ask, {"role": "assistant", "content": [b.to_dict() for b in out["forced"].content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "18 degrees celsius, sunny"}]}]
    out["follow_up"] = client.messages.create(model=name, max_tokens=24, messages=follow_up, tools=tools,
                                              extra_body=GREEDY)
    out["counts"] = [client.messages.count_tokens(model=name, messages=m, tools=tools).input_tokens
                     for m in (ask, follow_up)]
    out["parsed"] = client.messages.parse(model=name, max_tokens=96, output_format=City, extra_body=GREEDY,
                                          messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    return out


def responses_agent_calls(url: str, name: str) -> dict[str, Any]:
    responses = openai_client(url).responses
    tools: Any = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
                   "parameters": WEATHER_SCHEMA, "strict": True}]
    out: dict[str, Any] = {}
    out["call"] = responses.create(model=name, input=ASK, tools=tools, tool_choice="required", max_output_tokens=64,
                                   parallel_tool_calls=False, temperature=0)
    call = next(o for o in out["call"].output if o.type == "function_call")
    items: Any = [{"role": "user", "content": ASK},
                  {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees celsius, sunny"}]
    out["answer_events"] = list(responses.create(model=name, input=items, tools=tools, max_output_tokens=24,
                                                 temperature=0, stream=True))
    out["streamed_call"] = list(responses.create(model=name, input=ASK, tools=tools, max_output_tokens=64,
                                                 tool_choice={"type": "function", "name": "get_weather"},
                                                 temperature=0, stream=True))
    # The SDK sends text.format json_schema with its strict schema of City, and parses the answer back.
    out["json"] = responses.parse(model=name, input="Describe Paris as JSON.", max_output_tokens=96, temperature=0,
                                  text_format=City)
    return out


@pytest.mark.slow
async def test_anthropic_sdk_tools_and_structured_output_on_the_default_model(default_model: LoadedModel) -> None:
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=256)
    async with running_server(lambda: LLMEngine(config, loaded=default_model)) as serving:
        out = await trio.to_thread.run_sync(anthropic_agent_calls, serving.url, serving.services[0].model_name)
    forced = out["forced"]
    assert forced.stop_reason == "tool_use"
    (use,) = [b for b in forced.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    streamed = out["streamed"]
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    assert "input_json" in out["stream_events"] and out["stream_events"][-1] == "message_stop"
    follow_up = out["follow_up"]
    assert follow_up.content and follow_up.stop_reason in ("end_turn", "tool_use", "max_tokens")
    # The tool call and its result reached the prompt.
    assert out["counts"][1] > out["counts"][0] + len("18 degrees celsius, sunny") // 4
    parsed = out["parsed"]
    assert isinstance(parsed.parsed_output, City)
    jsonschema.validate(json.loads(parsed.content[0].text), City.model_json_schema())


@pytest.mark.slow
async def test_openai_sdk_responses_function_call_round_trip_and_json_schema(default_model: LoadedModel) -> None:
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=256)
    async with running_server(lambda: LLMEngine(config, loaded=default_model)) as serving:
        out = await trio.to_thread.run_sync(responses_agent_calls, serving.url, serving.services[0].model_name)
    call = out["call"]
    assert call.status == "completed"
    (fc,) = [o for o in call.output if o.type == "function_call"]
    assert fc.name == "get_weather" and fc.call_id and fc.id.startswith("fc_")
    jsonschema.validate(json.loads(fc.arguments), WEATHER_SCHEMA)
    answer = out["answer_events"]
    assert answer[-1].type in ("response.completed", "response.incomplete") and answer[-1].response.output
    streamed = out["streamed_call"]
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas == fc.arguments  # greedy: the same call
    assert streamed[-1].type == "response.completed"
    assert out["json"].status == "completed" and isinstance(out["json"].output_parsed, City)
    jsonschema.validate(json.loads(out["json"].output_text), City.model_json_schema())


# ---- reasoning and parsed tool calls, scripted (the mock engine answers a known prompt with a known text) ----

SCRIPT_ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCRIPT_ANSWER = ('<think>The user wants the weather.</think>Let me check.<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')


def scripted_calls(url: str) -> dict[str, Any]:
    client = anthropic_client(url)
    tools: Any = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_SCHEMA}]
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    out: dict[str, Any] = {}
    out["message"] = client.messages.create(model="mock-model", max_tokens=200, messages=SCRIPT_ASK, tools=tools,
                                            thinking=thinking)
    with client.messages.stream(model="mock-model", max_tokens=200, messages=SCRIPT_ASK, tools=tools,
                                thinking=thinking) as stream:
        out["message_events"] = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        out["streamed_message"] = stream.get_final_message()
    responses = openai_client(url).responses
    functions: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}]
    out["response"] = responses.create(model="mock-model", input="Weather in Paris?", tools=functions)
    with responses.stream(model="mock-model", input="Weather in Paris?", tools=functions) as rstream:
        out["response_events"] = [e.type for e in rstream]
        out["streamed_response"] = rstream.get_final_response()
    return out


async def test_thinking_and_tool_calls_through_both_sdks() -> None:
    async with running_server(scripted(SCRIPT_ASK, SCRIPT_ANSWER), tool_parser="json_tools",
                              reasoning_parser="think") as serving:
        out = await trio.to_thread.run_sync(scripted_calls, serving.url)
    want_blocks = [{"type": "thinking", "thinking": "The user wants the weather.", "signature": ""},
                   {"type": "text", "text": "Let me check."},
                   {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}]
    for message in (out["message"], out["streamed_message"]):
        assert message.stop_reason == "tool_use"
        blocks = [b.to_dict(exclude_none=True) for b in message.content]
        assert [{k: v for k, v in b.items() if k not in ("id", "citations", "parsed_output")} for b in blocks] == \
            want_blocks
    assert out["message"].content[2].id.startswith("call_")
    deltas = [d for kind, d in out["message_events"] if kind == "content_block_delta"]
    assert {"thinking_delta", "text_delta", "input_json_delta"} <= set(deltas)
    for response in (out["response"], out["streamed_response"]):
        assert response.status == "completed" and [o.type for o in response.output] == [
            "reasoning", "message", "function_call"]
        reasoning, message, call = response.output
        assert reasoning.content[0].text == "The user wants the weather." and message.content[0].text == "Let me check."
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert "response.reasoning_text.delta" in out["response_events"]
    assert "response.function_call_arguments.done" in out["response_events"]
