"""Tool calls end to end on a tiny random model per parser family: the chat template picks the family, the
grammar forces a call in that family's syntax (random weights could never write one), and the server parses
it back into OpenAI `tool_calls`, plain and streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.web.chat.features import model_features

from conftest import parse_sse, running_server
from tiny_model import CHATML_TEMPLATE, build_tiny_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "unit": {"type": "string", "enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Random weights spend the bounded whitespace the grammar allows between JSON tokens (16 per gap): room for it.
MAX_TOKENS = 512


def _with_tools(block: str) -> str:
    """ChatML with a system turn that shows the tools the way the family's template does."""
    return "{% if tools %}<|im_start|>system\n" + block + "<|im_end|>\n{% endif %}" + CHATML_TEMPLATE


# family -> (its template, the format the server detects, the syntax the forced call is written in)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "hermes": (_with_tools("<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Call a tool with "
                           "<tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>"), "hermes", "<tool_call>"),
    "mistral": (_with_tools("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS] Call tools with [TOOL_CALLS]"),
                "mistral", "[TOOL_CALLS]"),
    "llama3_json": (_with_tools("Tools: {{ tools | tojson }}. Answer a call as <|python_tag|>{\"name\": ..., "
                                "\"parameters\": ...}"), "llama3_json", "{"),
    # Families whose syntax is not JSON: the forced call is written (and parsed) in the Hermes syntax.
    "qwen3_coder": (_with_tools("<tools>{{ tools | tojson }}</tools> <tool_call>\n<function=NAME>"), "qwen3_coder",
                    "<tool_call>"),
    "pythonic": (_with_tools("<|tool_call_start|>[f(x=1)]<|tool_call_end|> {{ tools | tojson }}"), "pythonic",
                 "<tool_call>"),
    # A template that ignores `tools`: they go into the system prompt in the generic format.
    "generic": (CHATML_TEMPLATE, "generic", "<tool_call>"),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    models = {}
    for family, (template, _, _) in FAMILIES.items():
        path = build_tiny_model(tmp_path_factory.mktemp(family), seed=3)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["chat_template"] = template
        config_file.write_text(json.dumps(config))
        models[family] = path
    return models


def _engine(path: Path) -> Any:
    config = EngineConfig(model=str(path), max_num_seqs=4, num_kv_blocks=128, max_num_batched_tokens=256)
    return lambda: LLMEngine(config)


def _check_call(call: dict[str, Any], name: str) -> None:
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    assert args["city"] in ("Paris", "Rome")
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    else:
        assert set(args) == {"city"}


def _streamed_calls(events: list[Any]) -> tuple[list[dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    finish, text = None, ""
    for ev in events:
        if ev == "[DONE]" or not ev["choices"]:
            continue
        choice = ev["choices"][0]
        delta = choice["delta"]
        text += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"type": "function", "id": "", "function": {"name": "",
                                                                                                "arguments": ""}})
            call["id"] = piece.get("id") or call["id"]
            fn = piece.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return [calls[i] for i in sorted(calls)], finish, text


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_forced_call_parses_back_in_every_family(family: str, family_models: dict[str, Path]) -> None:
    _, detected, _ = FAMILIES[family]
    factory = _engine(family_models[family])
    async with running_server(factory) as serving:
        service = serving.services[0]
        assert service.tokenizer is not None
        assert model_features(service.tokenizer).tool_format.name == detected
        async with httpx.AsyncClient(base_url=serving.url, timeout=120) as client:
            named = {"messages": MESSAGES, "tools": [WEATHER, TIME], "max_tokens": MAX_TOKENS,
                     "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
            r = await client.post("/v1/chat/completions", json=named)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            assert choice["message"]["content"] in (None, "")
            [call] = choice["message"]["tool_calls"]
            _check_call(call, "get_time")

            required = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": MAX_TOKENS, "tool_choice": "required",
                        "parallel_tool_calls": False, "stream": True}
            r = await client.post("/v1/chat/completions", json=required)
            assert r.status_code == 200, r.text
            calls, finish, text = _streamed_calls(parse_sse(r.content))
            assert finish == "tool_calls" and text == "", (finish, text, calls)
            [call] = calls
            _check_call(call, "get_weather")
