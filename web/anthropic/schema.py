"""Anthropic Messages API request bodies as declared models (strict, validated from raw bytes by parse_body).

Content blocks are told apart by their `type`. Block and tool types this server cannot honour (images,
documents, Anthropic's server tools, ...) still validate here, as `OtherBlock` / a tool with another `type`,
so that the translation (translate.py) can refuse them with a message naming what is wrong. Fields that
change nothing here (`cache_control`, `metadata`, `citations`, `service_tier`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Tag

from trillm.web.openai.schema import MAX_MESSAGES, MAX_NAME, Name, StrictModel, Text, type_tag

MAX_BLOCKS = 4096
MAX_TOOLS = 1024
MAX_STOP_SEQUENCES = 1024  # the server's own cap (--max-stop-strings) applies later


CacheControl = dict[str, Any] | None  # accepted on every block and tool, ignored: the prefix cache is automatic


class TextBlock(StrictModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl = None
    citations: list[Any] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl = None


# The block kinds with their own models; the published schema's catch-all excludes them, so a named block is valid
# under exactly one member of its oneOf, as the tagged union routes it ({"type": "redacted_thinking"} alone fits both).
BLOCK_KINDS = ("redacted_thinking", "text", "thinking", "tool_result", "tool_use")


class OtherBlock(StrictModel):
    """A block type only named here (image, document, search_result, server tool results, ...)."""

    type: Annotated[str, Field(max_length=64, json_schema_extra={"not": {"enum": list(BLOCK_KINDS)}})]


ToolResultContent = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")], type_tag(frozenset({"text"}))]


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: Name
    content: Text | Annotated[list[ToolResultContent], Field(max_length=MAX_BLOCKS)] = ""
    is_error: bool = False
    cache_control: CacheControl = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: Text
    signature: Text = ""


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: Text = ""


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[OtherBlock, Tag("other")],
    type_tag(frozenset(BLOCK_KINDS)),
]


class Message(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[ContentBlock], Field(max_length=MAX_BLOCKS)]


class ToolDef(StrictModel):
    """A client tool (`type` absent or "custom"); any other `type` is one of Anthropic's server tools."""

    name: Name
    type: Annotated[str, Field(max_length=64)] | None = None
    description: Text | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl = None
    strict: bool | None = None


class ToolChoiceAuto(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(StrictModel):
    type: Literal["tool"]
    name: Name
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(StrictModel):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JSONOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


class _MessagesBase(StrictModel):
    """What shapes the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model: Annotated[str, Field(max_length=MAX_NAME)]
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(_MessagesBase):
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)] = []
    stream: bool = False
    # Anthropic's defaults when absent (current SDKs no longer send them): temperature 1, no top_p, no top_k.
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    metadata: dict[str, Any] | None = None
    # vLLM's extension, as on chat completions: prompts under different salts never share cached blocks.
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_NAME)] | None = None


class CountTokensRequest(_MessagesBase):
    pass
