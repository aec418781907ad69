"""The per-choice output parser over real outputs of several model families, streamed piece by piece.

Each output is fed whole, one character at a time, and split in two at every position (so every marker and
every JSON value is cut across deltas somewhere); all must give the same events, and no emitted text may
hold a partial marker.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trillm.engine.outputs import FinishReason
from trillm.web.chat.output_events import (
    ChoiceParser, OutputEnd, OutputEvent, OutputParsing, ReasoningDelta, TextDelta, ToolCallArgumentsDelta,
    ToolCallEnd, ToolCallStart,
)
from trillm.web.chat.reasoning import reasoning_format
from trillm.web.chat.tool_parsers import detect_tool_format, tool_format

TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}})


def run(parsing: OutputParsing, pieces: list[str], reason: FinishReason = FinishReason.STOP) -> list[OutputEvent]:
    parser = ChoiceParser(parsing)
    events: list[OutputEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish(reason)


def summary(events: list[OutputEvent]) -> dict[str, Any]:
    """What a client ends up with (ids are random, so only names and arguments count)."""
    calls: dict[int, dict[str, Any]] = {}
    for ev in events:
        if isinstance(ev, ToolCallStart):
            calls[ev.index] = {"name": ev.name, "arguments": ""}
        elif isinstance(ev, ToolCallArgumentsDelta):
            calls[ev.index]["arguments"] += ev.delta
        elif isinstance(ev, ToolCallEnd):
            assert calls[ev.index]["arguments"] == ev.arguments
    finishes = [ev for ev in events if isinstance(ev, OutputEnd)]
    assert len(finishes) == 1 and events[-1] is finishes[0]
    return {"text": "".join(ev.text for ev in events if isinstance(ev, TextDelta)),
            "reasoning": "".join(ev.text for ev in events if isinstance(ev, ReasoningDelta)),
            "calls": [{"name": c["name"], "arguments": json.loads(c["arguments"])} for _, c in sorted(calls.items())],
            "finish": finishes[0].reason}


def all_splits(parsing: OutputParsing, text: str, markers: tuple[str, ...]) -> dict[str, Any]:
    whole = summary(run(parsing, [text]))
    chars = run(parsing, list(text))
    assert summary(chars) == whole
    for ev in chars:  # no text delta carries a marker, whole or cut, when the marker opened a call or a block
        if isinstance(ev, TextDelta) and whole["calls"]:
            assert not any(m in ev.text or m[:-1] == ev.text[-len(m) + 1:] for m in markers if m)
    for i in range(1, len(text)):
        assert summary(run(parsing, [text[:i], text[i:]])) == whole, i
    return whole


HERMES = ("I'll check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", "
          "\"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": "
          "{\"tz\": \"Europe/Paris\"}}\n</tool_call>")


def test_hermes_qwen_calls_with_text_before() -> None:
    parsing = OutputParsing(tool_format("hermes"), TOOLS)
    out = all_splits(parsing, HERMES, ("<tool_call>",))
    assert out["text"].strip() == "I'll check both."
    assert out["calls"] == [{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}},
                            {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]
    assert out["finish"] == "tool_calls"


def test_no_partial_marker_is_ever_emitted() -> None:
    parsing = OutputParsing(tool_format("hermes"), TOOLS)
    parser = ChoiceParser(parsing)
    emitted = ""
    for ch in "ok <tool":
        emitted += "".join(ev.text for ev in parser.feed(ch) if isinstance(ev, TextDelta))
    assert emitted == "ok "  # "<tool" may still become "<tool_call>"
    emitted += "".join(ev.text for ev in parser.feed("s> are fine") if isinstance(ev, TextDelta))
    assert emitted == "ok <tools> are fine"


def test_llama3_json_calls() -> None:
    parsing = OutputParsing(tool_format("llama3_json"), TOOLS)
    bare = '{"name": "get_weather", "parameters": {"location": "Paris"}}'
    assert all_splits(parsing, bare, ())["calls"] == [{"name": "get_weather", "arguments": {"location": "Paris"}}]
    tagged = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_weather", ' \
             '"parameters": {"location": "Oslo"}}'
    out = all_splits(parsing, tagged, ("<|python_tag|>",))
    assert [c["name"] for c in out["calls"]] == ["get_time", "get_weather"] and out["text"] == ""
    # plain text that merely mentions braces later is text
    out = all_splits(parsing, "The answer is {42}.", ())
    assert out["text"] == "The answer is {42}." and out["calls"] == [] and out["finish"] == "stop"


def test_mistral_calls_both_syntaxes() -> None:
    parsing = OutputParsing(tool_format("mistral"), TOOLS)
    v3 = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}}, {"name": "get_time", ' \
         '"arguments": {"tz": "CET"}}]'
    out = all_splits(parsing, v3, ("[TOOL_CALLS]",))
    assert [c["name"] for c in out["calls"]] == ["get_weather", "get_time"]
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"location": "Rome"}'
    assert all_splits(parsing, v11, ("[TOOL_CALLS]",))["calls"] == [
        {"name": "get_weather", "arguments": {"location": "Rome"}}]


def test_qwen3_coder_xml_call() -> None:
    parsing = OutputParsing(tool_format("qwen3_coder"), TOOLS)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n"
            "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    out = all_splits(parsing, text, ("<tool_call>",))
    assert out["calls"] == [{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}]


def test_reasoning_then_call_qwen3() -> None:
    parsing = OutputParsing(tool_format("hermes"), TOOLS, reasoning_format("think"), False)
    text = ('<think>\nThe user wants the weather; 2 < 3 and </thin is not the end.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>')
    out = all_splits(parsing, text, ("<think>", "</think>", "<tool_call>"))
    assert out["reasoning"] == "\nThe user wants the weather; 2 < 3 and </thin is not the end.\n"
    assert out["calls"][0]["name"] == "get_weather" and out["text"] == ""


def test_reasoning_opened_by_the_prompt_and_plain_answer() -> None:
    parsing = OutputParsing(reasoning=reasoning_format("think"), reasoning_inside=True)
    out = all_splits(parsing, "Let me think.</think>\n\nParis.", ("</think>",))
    assert out == {"text": "Paris.", "reasoning": "Let me think.", "calls": [], "finish": "stop"}
    # a model that does not think: everything is the answer
    out = all_splits(OutputParsing(reasoning=reasoning_format("think")), "Paris is the capital.", ("<think>",))
    assert out["text"] == "Paris is the capital." and out["reasoning"] == ""


def test_a_block_that_does_not_parse_stays_text() -> None:
    parsing = OutputParsing(tool_format("hermes"), TOOLS)
    text = "Sure <tool_call>not json</tool_call> done"
    out = all_splits(parsing, text, ("<tool_call>",))
    assert out["text"] == text and out["calls"] == [] and out["finish"] == "stop"


def test_truncated_call_at_length() -> None:
    parsing = OutputParsing(tool_format("hermes"), TOOLS)
    out = summary(run(parsing, ['<tool_call>\n{"name": "get_weather", "argu'], FinishReason.LENGTH))
    assert out["calls"] == [] and out["text"] == '<tool_call>\n{"name": "get_weather", "argu'
    assert out["finish"] == "length"


@pytest.mark.parametrize("template, expected", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{\"name\": ...", "hermes"),
    ("<tool_call>\n<function={{ name }}>", "qwen3_coder"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ("<|python_tag|>{{ tool_call.name }}", "llama3_json"),
    ("<|tool_call_start|>[f(x=1)]<|tool_call_end|>", "pythonic"),
])
def test_detection_from_the_template(template: str, expected: str) -> None:
    assert detect_tool_format(template, set(), renders_tools=True) == expected
    assert detect_tool_format(template, set(), renders_tools=False) == "generic"
