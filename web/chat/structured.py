"""Structured output for one chat request: which grammar constrains the output (tool_choice required/named;
response_format and the vLLM-style extensions for the answer, after any thinking block), and the
`OutputParsing` of the output. The model's formats come from features.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from trillm.engine.errors import InvalidRequest
from trillm.engine.grammar import GrammarSpec, grammar_compiler
from trillm.engine.tokenizer import TokenizerLike
from trillm.web.chat.features import ModelFeatures, ToolRequest
from trillm.web.chat.output_events import OutputParsing
from trillm.web.chat.reasoning import ReasoningFormat
from trillm.web.chat.tool_parsers import ToolFormat, calls_grammar, json_options, select_tools

AnswerKind = Literal["json_schema", "regex", "lark", "choice"]


@dataclass(frozen=True, slots=True)
class AnswerSpec:
    """What the answer must match: a JSON schema (JSON text), a regex, a Lark/GBNF grammar, or one of a list
    of strings (a JSON array)."""

    kind: AnswerKind
    source: str
    lenient: bool = False  # json_schema: ignore keywords the grammar engine does not enforce (non-strict)


def _marker_is_special(tokenizer: TokenizerLike, marker: str) -> bool:
    if not marker:
        return False
    ids = tokenizer.encode(marker, add_special_tokens=False)
    specials = set(getattr(tokenizer, "all_special_ids", ()))
    return len(ids) == 1 and ids[0] in specials


def _lark_text(source: str) -> str:
    """A Lark grammar; GBNF/EBNF (`::=` rules, llama.cpp's format) is converted by llguidance."""
    if "::=" in source:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return str(any_to_lark(source))
        except Exception as exc:
            raise InvalidRequest(f"invalid grammar (GBNF): {exc}") from None
    return source


def _answer_part(answer: AnswerSpec) -> dict[str, Any]:
    """The answer as one entry of an llguidance grammar list."""
    if answer.kind == "json_schema":
        schema = json.loads(answer.source)
        return {"json_schema": json_options(schema, lenient=answer.lenient) if isinstance(schema, dict) else schema}
    if answer.kind == "regex":
        import llguidance

        return {"lark_grammar": f"start: /{llguidance.regex_to_lark(answer.source)}/\n"}
    if answer.kind == "choice":
        options = json.loads(answer.source)
        return {"lark_grammar": "start: " + " | ".join(json.dumps(o) for o in options) + "\n"}
    return {"lark_grammar": _lark_text(answer.source)}


def _single(part: dict[str, Any]) -> GrammarSpec:
    if "json_schema" in part:
        return GrammarSpec("json_schema", json.dumps(part["json_schema"]))
    return GrammarSpec("lark", part["lark_grammar"])


def _after_thinking(part: dict[str, Any], fmt: ReasoningFormat, inside: bool, tokenizer: TokenizerLike) -> GrammarSpec:
    """`part` applies to the answer; the thinking block before it is free text."""
    start, end = fmt.start, fmt.end
    if _marker_is_special(tokenizer, end):
        # A special token never matches text, so the free text simply ends where the model emits it.
        end_id = tokenizer.encode(end, add_special_tokens=False)[0]
        body = f"/(.|\\n)*/ <[{end_id}]>"
    else:
        body = f"think_text\nthink_text[suffix={json.dumps(end)}]: /(.|\\n)*/"
    if _marker_is_special(tokenizer, start):
        opener = f"<[{tokenizer.encode(start, add_special_tokens=False)[0]}]>"
    else:
        opener = json.dumps(start)
    head = "think" if inside else f"({opener} think)?"
    main = f"start: ws {head} ws @answer\nthink: {body}\nws: /[ \\t\\r\\n]{{0,16}}/\n"
    return GrammarSpec("llguidance", json.dumps({"grammars": [{"name": "main", "lark_grammar": main},
                                                              {"name": "answer", **part}]}))


@dataclass(frozen=True, slots=True)
class OutputPlan:
    grammar: GrammarSpec | None
    parsing: OutputParsing
    keep_special_tokens: bool  # the markers the parsers need are special tokens: keep them in the text


def output_plan(prompt_ids: list[int], tokenizer: TokenizerLike, features: ModelFeatures | None,
                tools: ToolRequest | None, answer: AnswerSpec | None) -> OutputPlan:
    """The grammar (validated: InvalidRequest names what is wrong) and the parsing of one request's output.
    features None (a plain completion): no reasoning split, no tools."""
    reasoning = features.reasoning if features is not None else None
    inside = False
    if reasoning is not None:
        tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False)
        inside = reasoning.starts_inside(tail)
    fmt: ToolFormat | None = None
    part: dict[str, Any] | None = None
    calling = tools is not None and tools.choice != "none" and bool(tools.tools)
    if calling and tools is not None and features is not None:
        fmt = features.tool_format
        if tools.choice in ("required", "named"):
            chosen = select_tools(list(tools.tools), tools.name if tools.choice == "named" else None)
            lark, fmt = calls_grammar(fmt, chosen, parallel=tools.parallel and tools.choice == "required",
                                      tokenizer=tokenizer)
            part = {"lark_grammar": lark}
    if part is None and answer is not None:
        part = _answer_part(answer)
    grammar = None
    if part is not None:
        grammar = _after_thinking(part, reasoning, inside, tokenizer) if reasoning is not None else _single(part)
        grammar = grammar_compiler(tokenizer).validate(grammar)  # compiled here, off the engine thread
    keep = bool(fmt is not None and (_marker_is_special(tokenizer, fmt.start) or _marker_is_special(tokenizer, fmt.end)))
    keep = keep or bool(reasoning is not None and (_marker_is_special(tokenizer, reasoning.start)
                                                   or _marker_is_special(tokenizer, reasoning.end)))
    parsing = OutputParsing(fmt, tools.tools if calling and tools is not None else (), reasoning, inside)
    return OutputPlan(grammar, parsing, keep)
