"""Tools and structured output through the official openai SDK and LangChain, against a live server on the
default model (SmolLM2-135M: its template ignores tools, so the generic format is what it sees)."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
import trio
from pydantic import BaseModel, Field

from trillm.engine.admission import RequestLimits
from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.web.errors import parse_body
from trillm.web.openai.request import Limits, parse_generation
from trillm.web.openai.schema import ChatCompletionRequest

from conftest import running_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 24}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    kind: Literal["capital", "other"]


def factory(model: LoadedModel) -> Any:
    # The batch limits of the other default-model tests: one kernel self-check (~8 s) serves them all.
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=256, max_num_batched_tokens=256)
    return lambda: LLMEngine(config, loaded=model)


def schema_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]["parameters"]  # type: ignore[no-any-return]


def streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, Any]], str | None, list[Any]]:
    """Accumulate streamed tool calls the way OpenAI's docs do: by index, name once, arguments appended."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    pieces = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            pieces.append(tc)
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
    return [calls[i] for i in sorted(calls)], finish, pieces


def sdk_session(url: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out: dict[str, Any] = {}
    out["parsed"] = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_tokens=120, temperature=0)
    out["json_object"] = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Reply with a JSON object with a cat's name and age."}],
        response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for key, choice in (("named", named), ("required", "required")):
        out[key] = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                                  max_tokens=120, temperature=0, parallel_tool_calls=False)
        out[key + "_stream"] = list(client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120, temperature=0,
            parallel_tool_calls=False, stream=True))
    call = out["named"].choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})}]
    out["tool_result"] = client.chat.completions.create(model=model, messages=history, tools=[WEATHER, TIME],
                                                        max_tokens=40, temperature=0)
    out["history"] = history
    try:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}, "strict": True}})
    except openai.BadRequestError as exc:
        out["bad_schema"] = exc
    try:
        client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    except openai.BadRequestError as exc:
        out["bad_tool"] = exc
    return out


async def test_openai_sdk_structured_output_and_tools(default_model: LoadedModel) -> None:
    async with running_server(factory(default_model)) as serving:
        out = await trio.to_thread.run_sync(sdk_session, serving.url)

    parsed = out["parsed"].choices[0].message.parsed
    assert isinstance(parsed, City) and out["parsed"].choices[0].finish_reason == "stop"
    content = out["json_object"].choices[0].message.content
    assert out["json_object"].choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict)

    for key in ("named", "required"):
        message = out[key].choices[0].message
        assert out[key].choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        tool = WEATHER if call.function.name == "get_weather" else TIME
        assert key == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema_of(tool))
        calls, finish, pieces = streamed_calls(out[key + "_stream"])
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0]["name"] == call.function.name and calls[0]["arguments"] == call.function.arguments
        # OpenAI's order: the first piece names the call (id, type, name, empty arguments), then arguments
        first = pieces[0]
        assert first.id and first.type == "function" and first.function.name and first.function.arguments == ""
        assert all(p.id is None and p.function.name is None for p in pieces[1:])
        assert not any(c.choices and c.choices[0].delta.content for c in out[key + "_stream"])

    result = out["tool_result"].choices[0]
    assert result.finish_reason in ("stop", "length", "tool_calls")
    # the template (generic format) saw the call and its result: the prompt the server built for that turn
    body = parse_body(ChatCompletionRequest, json.dumps({"messages": out["history"], "tools": [WEATHER, TIME]}))
    req = parse_generation(body, "m", default_model.tokenizer, RequestLimits(2048, 16, 1000, 49152, 10), Limits())
    text = default_model.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)
    assert "<tool_call>" in text and '"get_weather"' in text and "<tool_response>" in text and "temperature_c" in text
    assert "get_time" in text  # the tools, in the system prompt

    assert out["bad_schema"].status_code == 400 and "nonsense" in str(out["bad_schema"])
    assert out["bad_tool"].status_code == 400 and "nope" in str(out["bad_tool"])


def langchain_session(url: str) -> dict[str, Any]:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url + "/v1", api_key="k", model="SmolLM2-135M-Instruct", temperature=0, max_tokens=120,
                     max_retries=0, timeout=120)
    out: dict[str, Any] = {}
    out["structured"] = llm.with_structured_output(City).invoke("Describe Paris.")
    out["tools"] = llm.bind_tools([WEATHER, TIME], tool_choice="get_weather").invoke("Weather in Oslo?")
    out["tools_stream"] = None
    for chunk in llm.bind_tools([WEATHER, TIME], tool_choice="required").stream("Weather in Oslo?"):
        out["tools_stream"] = chunk if out["tools_stream"] is None else out["tools_stream"] + chunk
    return out


async def test_langchain_structured_output_and_tools(default_model: LoadedModel) -> None:
    async with running_server(factory(default_model)) as serving:
        out = await trio.to_thread.run_sync(langchain_session, serving.url)
    assert isinstance(out["structured"], City)
    (call,) = out["tools"].tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], schema_of(WEATHER))
    streamed = out["tools_stream"].tool_calls  # parallel calls are allowed here
    assert streamed
    for call in streamed:
        jsonschema.validate(call["args"], schema_of(WEATHER if call["name"] == "get_weather" else TIME))
