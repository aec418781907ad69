"""OpenAI Responses API request bodies as declared models (strict, validated from raw bytes by parse_body).

This server is stateless: it keeps no responses, conversations or files. Input items and tools of kinds it
cannot honour still validate here (`OtherItem`, `OtherTool`, `OtherPart`), so that the translation
(translate.py) refuses them with a message naming what is wrong rather than a bare tag mismatch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Tag

from trillm.web.openai.schema import MAX_MESSAGES, MAX_NAME, Name, StrictModel, Text, type_tag

MAX_PARTS = 4096
MAX_TOOLS = 1024


Kind = Annotated[str, Field(max_length=64)]
PART_KINDS = frozenset({"input_text", "output_text", "refusal"})
ITEM_KINDS = frozenset({"message", "function_call", "function_call_output", "reasoning"})
TOOL_KINDS = frozenset({"function"})


# The `type` of each union's catch-all member: any kind but the union's named ones. Validation routes by the tag
# already; the published schema says so too, so that a body matches exactly one member of its oneOf.
OtherPartKind = Annotated[str, Field(max_length=64, json_schema_extra={"not": {"enum": sorted(PART_KINDS)}})]
OtherItemKind = Annotated[str, Field(max_length=64, json_schema_extra={"not": {"enum": sorted(ITEM_KINDS)}})]
OtherToolKind = Annotated[str, Field(max_length=64, json_schema_extra={"not": {"enum": sorted(TOOL_KINDS)}})]


class TextPart(StrictModel):
    type: Literal["input_text", "output_text"]
    text: Text


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: Text


class OtherPart(StrictModel):
    """input_image, input_file, input_audio, ..."""

    type: OtherPartKind


Part = Annotated[
    Annotated[TextPart, Tag("input_text")] | Annotated[TextPart, Tag("output_text")]
    | Annotated[RefusalPart, Tag("refusal")] | Annotated[OtherPart, Tag("other")],
    type_tag(PART_KINDS),
]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[Part], Field(max_length=MAX_PARTS)]
    id: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    status: Kind | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: Text
    id: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    status: Kind | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: Name
    output: Text | Annotated[list[Part], Field(max_length=MAX_PARTS)]
    id: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    status: Kind | None = None


class ReasoningItem(StrictModel):
    """An earlier turn's reasoning, sent back by clients such as Codex; chat templates drop it."""

    type: Literal["reasoning"]
    id: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: Text | None = None


class OtherItem(StrictModel):
    """item_reference, built-in tools' calls and outputs, ..."""

    type: OtherItemKind


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    type_tag(ITEM_KINDS, default="message"),
]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: Name
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class OtherTool(StrictModel):
    """web_search, file_search, code_interpreter, computer_use, mcp, local_shell, ...: built-in tools."""

    type: OtherToolKind


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
    type_tag(TOOL_KINDS),
]


class NamedFunction(StrictModel):
    type: Kind
    name: Name | None = None


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    description: Text | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(StrictModel):
    model: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    include: list[Kind] | None = None  # accepted; there is nothing extra to include
    truncation: Literal["auto", "disabled"] | None = None
    user: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's extension, as on chat completions: prompts under different salts never share cached blocks.
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_NAME)] | None = None

    # What a stateless server cannot do: each is refused with a clear 400 when asked for.
    store: bool | None = None
    previous_response_id: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
