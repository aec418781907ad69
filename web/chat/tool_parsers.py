"""Tool-call formats: how a model writes a call, how to read it back, and a grammar that forces one.

mlx-lm ships the parsers (`mlx_lm.tool_parsers.<name>`: a `parse_tool_call(text, tools)` for the text between
the module's `tool_call_start` and `tool_call_end`); `ToolFormat` wraps one behind a small interface. The
format is detected here from the chat template and the vocabulary (mlx-lm's own detection is private and has
changed between versions), or named with `trillm serve --tool-parser NAME`.

Models whose chat template ignores `tools` (the default SmolLM2 among them) get the GENERIC format, as
llama.cpp's server does: the tools are rendered into the system prompt (`GENERIC_TOOLS_PROMPT`) asking for
Hermes-style calls, one per `<tool_call>` block holding `{"name": ..., "arguments": {...}}`, and that format
is parsed back (mlx-lm's json_tools). Assistant tool calls and tool results in the history are rendered the
same way for such templates.

`tool_choice` "required" and a named function are enforced by a grammar (engine/grammar.py): formats whose
call body is JSON (generic/json_tools, llama3_json, mistral) get a grammar in their own syntax; for the others
the grammar forces the generic syntax, which is then what is parsed.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from trillm.engine.errors import InvalidRequest
from trillm.engine.grammar import JSON_WHITESPACE
from trillm.engine.tokenizer import TokenizerLike

ParseFn = Callable[[str, list[dict[str, Any]] | None], Any]

GENERIC_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)
    id: str | None = None  # the model's own id, when its format carries one (Mistral)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One model family's tool-call syntax."""

    name: str
    start: str  # the text that opens a call block
    end: str  # the text that closes it; "" = the block runs to the end of the output
    parse_fn: ParseFn
    json_body: str | None = None  # the grammar's call syntax: "hermes", "mistral" or "llama3"; None: no grammar
    call_at_start: bool = False  # a bare JSON object at the start of the output is a call (Llama 3)
    renders_tools: bool = True  # False: the generic format (tools go into the system prompt)

    def parse(self, body: str, tools: list[dict[str, Any]] | None) -> list[ParsedCall]:
        """The calls in one block's body; ValueError if it is not a call in this format."""
        try:
            parsed = self.parse_fn(body, tools)
        except (ValueError, TypeError, KeyError, SyntaxError, AttributeError) as exc:
            raise ValueError(f"not a {self.name} tool call: {exc}") from exc
        return normalize_calls(parsed)


def normalize_calls(parsed: Any) -> list[ParsedCall]:
    """mlx-lm parsers return one {"name", "arguments"} dict or a list of them; arguments may be text."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError("a tool call needs a name")
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise ValueError(f"tool call arguments are not JSON: {exc}") from exc
        if not isinstance(args, dict):
            raise ValueError("tool call arguments must be a JSON object")
        call_id = item.get("id")
        calls.append(ParsedCall(item["name"], json.dumps(args, ensure_ascii=False),
                                call_id if isinstance(call_id, str) and call_id else None))
    return calls


def _llama3_parse(text: str, tools: list[dict[str, Any]] | None) -> Any:
    """Llama 3.x JSON calls: {"name": ..., "parameters": {...}}, several separated by ';' (mlx-lm has none)."""
    decoder = json.JSONDecoder()
    calls: list[Any] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        calls.append(obj)
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    if not calls:
        raise ValueError("no JSON object")
    return calls


def _mlx_lm_format(module_name: str, **kw: Any) -> ToolFormat:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
    return ToolFormat(kw.pop("name", module_name), str(module.tool_call_start), str(module.tool_call_end),
                      module.parse_tool_call, **kw)


# name -> builder (mlx-lm modules are imported only when their format is used)
_FORMATS: dict[str, Callable[[], ToolFormat]] = {
    "generic": lambda: _mlx_lm_format("json_tools", name="generic", json_body="hermes", renders_tools=False),
    "hermes": lambda: _mlx_lm_format("json_tools", name="hermes", json_body="hermes"),
    "json_tools": lambda: _mlx_lm_format("json_tools", json_body="hermes"),
    "mistral": lambda: _mlx_lm_format("mistral", json_body="mistral"),
    "llama3_json": lambda: ToolFormat("llama3_json", "<|python_tag|>", "", _llama3_parse, json_body="llama3",
                                      call_at_start=True),
    "qwen3_coder": lambda: _mlx_lm_format("qwen3_coder"),
    "pythonic": lambda: _mlx_lm_format("pythonic"),
    "glm47": lambda: _mlx_lm_format("glm47"),
    "kimi_k2": lambda: _mlx_lm_format("kimi_k2"),
    "minimax_m2": lambda: _mlx_lm_format("minimax_m2"),
    "gemma4": lambda: _mlx_lm_format("gemma4"),
    "function_gemma": lambda: _mlx_lm_format("function_gemma"),
    "longcat": lambda: _mlx_lm_format("longcat"),
}
TOOL_PARSERS = tuple(_FORMATS)


@lru_cache(maxsize=None)
def tool_format(name: str) -> ToolFormat:
    if name not in _FORMATS:
        raise ValueError(f"unknown tool parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return _FORMATS[name]()


def detect_tool_format(template: str | None, vocab: set[str], renders_tools: bool) -> str:
    """The tool parser for a chat template: by its markers, the way the model was trained to call tools."""
    if not renders_tools:
        return "generic"
    if not template:
        return "hermes"  # it renders tools, in a template we cannot read: the common syntax
    markers = [
        ("<minimax:tool_call>", "minimax_m2"), ("<|tool_call>", "gemma4"), ("<start_function_call>", "function_gemma"),
        ("<longcat_tool_call>", "longcat"), ("<arg_key>", "glm47"), ("<|tool_call_start|>", "pythonic"),
        ("<tool_call>\\n<function=", "qwen3_coder"), ("<tool_call>\n<function=", "qwen3_coder"),
        ("<|tool_calls_section_begin|>", "kimi_k2"), ("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"),
        ("<|python_tag|>", "llama3_json"), ('"parameters": d', "llama3_json"),
    ]
    for marker, name in markers:
        if marker in template:
            return name
    if "<|tool_call_start|>" in vocab:
        return "pythonic"
    return "hermes"  # a template that renders tools in a syntax we do not know: Hermes is the common one


_PROBE_TOOL = {"type": "function", "function": {"name": "zz_probe_tool_zz", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


def template_renders_tools(tokenizer: TokenizerLike) -> bool:
    """Whether the chat template shows `tools` to the model (rendering with and without a probe tool)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        with_tool = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL])
        without = tokenizer.apply_chat_template(messages, tools=None)
    except Exception:  # a template that fails on tools does not render them
        return False
    return list(with_tool) != list(without)


# ---- the generic format's prompt and history ----

def render_generic_history(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that ignores tools: the tools in the system prompt, assistant calls as
    <tool_call> blocks in its content, tool results as <tool_response> blocks of a user turn."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False) for c in m.pop("tool_calls")]
            text = m.get("content") or ""
            m["content"] = (text + "\n" if text else "") + "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools:
        text = GENERIC_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# ---- grammars for tool_choice "required" and a named function ----

def _call_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def json_options(schema: dict[str, Any], *, lenient: bool) -> dict[str, Any]:
    """`schema` with llguidance's compile options: bounded whitespace, and (lenient) keywords llguidance does
    not enforce ignored rather than refused."""
    given = schema.get("x-guidance", {})
    if not isinstance(given, dict):  # llguidance's compile options: an object, or a 400 (not a TypeError)
        raise InvalidRequest(f"'x-guidance' must be an object of llguidance options, got {type(given).__name__}")
    options = {**given, "whitespace_pattern": JSON_WHITESPACE}
    if lenient:
        options["lenient"] = True
    return {**schema, "x-guidance": options}


def _one_of(schemas: list[dict[str, Any]], lenient: bool) -> dict[str, Any]:
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return json_options(schema, lenient=lenient)  # lenient unless a tool asked to be strict


def _special(tokenizer: TokenizerLike, text: str) -> str:
    """A marker as a Lark element: its special token's id when it is one, else the literal text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = set(getattr(tokenizer, "all_special_ids", ())) | set(tokenizer.eos_token_ids)
    if len(ids) == 1 and ids[0] in specials:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def calls_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], *, parallel: bool,
                  tokenizer: TokenizerLike) -> tuple[str, ToolFormat]:
    """A Lark grammar (a `start` rule) for one or more calls of `tools`, and the format it produces."""
    if fmt.json_body is None:
        fmt = tool_format("hermes")  # this family's syntax is not JSON: force (and parse) the generic one
    lenient = not any(t["function"].get("strict") for t in tools)
    repeat = ' (ws call)*' if parallel else ''
    if fmt.json_body == "mistral":
        items: dict[str, Any] = {"type": "array", "items": _one_of([_call_schema(t, "arguments") for t in tools],
                                                                   lenient), "minItems": 1}
        if not parallel:
            items["maxItems"] = 1
        # The compile options must sit on the outermost schema: there they bound the whitespace in the array too.
        array = json.dumps(json_options(items, lenient=lenient))
        return f"start: {_special(tokenizer, fmt.start)} %json {array}\n", fmt
    if fmt.json_body == "llama3":
        schema = _one_of([_call_schema(t, "parameters") for t in tools], lenient)
        sep = ' (";" ws call)*' if parallel else ''
        return f"start: call{sep}\ncall: %json {json.dumps(schema)}\nws: /[ \\t\\n]{{0,16}}/\n", fmt
    schema = _one_of([_call_schema(t, "arguments") for t in tools], lenient)
    start, end = _special(tokenizer, fmt.start), _special(tokenizer, fmt.end)
    return (f"start: call{repeat}\ncall: {start} ws %json {json.dumps(schema)} ws {end}\nws: /[ \\t\\n]{{0,16}}/\n",
            fmt)


def select_tools(tools: list[dict[str, Any]], forced: str | None) -> list[dict[str, Any]]:
    if forced is None:
        return tools
    chosen = [t for t in tools if t["function"]["name"] == forced]
    if not chosen:
        raise InvalidRequest(f"'tool_choice' names the function {forced!r}, which is not in 'tools' "
                             f"({', '.join(t['function']['name'] for t in tools) or 'none given'})")
    return chosen
