"""OpenAI request bodies as declared models: every field's type, range and size is checked here, once.

Bodies are validated from their raw bytes (`parse_body`) in pydantic's strict mode: no silent coercion
("5" is not 5, true is not 1), no NaN or infinity, no invalid UTF-8 or lone surrogates (the JSON parser
rejects them), bounded nesting. Unknown fields are ignored, as OpenAI's own server does, except those we
know and refuse (`suffix`, chat's `echo`, ...), which get a clear 400. Limits that depend on the served model
(the vocabulary, the context) are checked later, in request.py, when the model is known.

The models' JSON schemas are what /openapi.json publishes, for users and for fuzzers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, field_validator


MAX_ID = 2**31 - 1  # token ids and the like
MAX_SEED = 2**63 - 1  # a seed is derived into a 64-bit key: larger ones would only cost CPU
MAX_MESSAGES = 4096
MAX_NAME = 256

Text = Annotated[str, Field(max_length=4 << 20)]
TokenId = Annotated[int, Field(ge=0, le=MAX_ID)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]


class StrictModel(BaseModel):
    """A request body's model: strict types, unknown fields ignored, no inf or nan (the APIs' schemas share it)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


def type_tag(kinds: frozenset[str], default: str | None = None) -> Any:
    """A union's discriminator by `type`: one of `kinds`, else "other" (a catch-all the translation refuses by
    name, rather than pydantic's bare tag mismatch)."""
    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return kind if isinstance(kind, str) and kind in kinds else "other"  # a dict is unhashable
    return Discriminator(tag)


class TextPart(StrictModel):
    type: Annotated[str, Field(max_length=64)]
    text: Text = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"only text content parts are supported (this model takes text only), got {value[:32]!r}")
        return value


class ToolCallFunction(StrictModel):
    name: Annotated[str, Field(max_length=MAX_NAME)]
    arguments: Text = ""  # a JSON string, as OpenAI sends it


class ToolCall(StrictModel):
    id: Annotated[str, Field(max_length=MAX_NAME)] = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(max_length=MAX_NAME)] | None = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class FunctionDef(StrictModel):
    name: Name
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(StrictModel):
    include_usage: bool = False


Schema = dict[str, Any]
GrammarText = Annotated[str, Field(min_length=1, max_length=1 << 20)]


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False, populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: Text | None = None
    schema_: Schema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (one of them): the output matches a JSON schema, a regex, a Lark or GBNF
    grammar, one of a list of strings, or any JSON object."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False, populate_by_name=True)

    json_: Schema | GrammarText | None = Field(default=None, alias="json")
    regex: GrammarText | None = None
    grammar: GrammarText | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(min_length=1, max_length=1024)] | None = None
    json_object: bool | None = None


class NamedFunction(StrictModel):
    name: Name


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(StrictModel):
    """The sampling and stopping fields both endpoints share (OpenAI's names, plus vLLM's extensions)."""

    model: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    max_tokens: Annotated[int, Field(ge=0, le=MAX_ID)] | None = None  # 0: score the prompt, generate nothing
    min_tokens: Annotated[int, Field(ge=0, le=MAX_ID)] = 0
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=MAX_ID)] = 0  # 0 and -1 (vLLM's "off") disable it
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Annotated[int, Field(ge=-MAX_SEED, le=MAX_SEED)] | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Lower runs first; a request may only lower its own priority (never jump the queue).
    priority: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    user: Annotated[str, Field(max_length=MAX_NAME)] | None = None  # accepted, ignored
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_NAME)] | None = None
    # Constrained output, with vLLM's names (both endpoints; chat also takes response_format).
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | GrammarText | None = None
    guided_regex: GrammarText | None = None
    guided_grammar: GrammarText | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(min_length=1, max_length=1024)] | None = None
    guided_decoding_backend: Annotated[str, Field(max_length=64)] | None = None  # accepted, ignored: llguidance
    guided_whitespace_pattern: Annotated[str, Field(max_length=256)] | None = None  # accepted, ignored
    # vLLM's extension: every prompt token's logprob, with this many top alternatives (range: request.py).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_ID)] | None = None
    # trillm's extension: false keeps this request out of speculative decoding (when the server runs it).
    speculative: bool = True

    # Known and refused: silently ignoring it would return something the client did not ask for.
    suffix: Any = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or int(key) > MAX_ID:
                raise ValueError(f"logit_bias keys must be token ids (decimal strings), got {key[:32]!r}")
        return value


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_ID)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    tools: Annotated[list[Tool], Field(max_length=1024)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # accepted, ignored
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Known and refused here (completions-only, or vLLM's chat variants we do not implement).
    echo: Any = None
    best_of: Any = None


Prompt = Text | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Text], Field(min_length=1)] | Annotated[
    list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Prompt  # a batch (a list of texts or of token-id lists) gets one set of n choices per prompt
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False  # the prompt before each choice's text (and its logprobs before the choice's)
    best_of: Annotated[int, Field(ge=1, le=MAX_ID)] | None = None  # only best_of = n (request.py)


class TokenizeRequest(StrictModel):
    model: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(StrictModel):
    model: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    tokens: list[TokenId]


OPENAI_ROUTES: tuple[tuple[str, type[BaseModel]], ...] = (
    ("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
    ("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest))


def openapi_document(routes: Sequence[tuple[str, type[BaseModel]]] = OPENAI_ROUTES) -> dict[str, Any]:
    """A minimal OpenAPI 3.1 document of the request bodies (responses are the APIs' own), for /openapi.json."""
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for path, model in routes:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        paths[path] = {"post": {
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "OK"}, "400": {"description": "invalid request"}},
        }}
    return {"openapi": "3.1.0", "info": {"title": "trillm", "version": "0.1"}, "paths": paths,
            "components": {"schemas": schemas}}
