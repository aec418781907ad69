"""A request's prompt token ids, computed the way a replica computes them, for routing only.

The replica parses and validates every request itself (the router forwards the body untouched), so a prompt
the router cannot tokenize is simply routed without KV information; a wrong guess costs a cache miss, never
a wrong answer. Local tokenization uses the same functions as the replicas (web/openai/request.py) with the same
tokenizer: loaded from the model's files (`--tokenizer PATH`), or the mock engine's, and in either case
checked once against the replica's own POST /tokenize before it is trusted.
"""

from __future__ import annotations

from typing import Any, Literal

from trillm.engine.errors import InvalidRequest
from trillm.engine.tokenizer import TokenizerLike
from trillm.web.anthropic.schema import MessagesRequest
from trillm.web.anthropic.translate import chat_body as messages_chat_body
from trillm.web.errors import parse_object
from trillm.web.openai.request import generation_prompt_ids, tool_request
from trillm.web.openai.schema import ChatCompletionRequest, CompletionRequest
from trillm.web.responses.schema import ResponsesRequest
from trillm.web.responses.translate import chat_body as responses_chat_body
from trillm.web.ws.envelope import generate_fields

# chat and completion: OpenAI's endpoints; messages and responses: Anthropic's Messages and OpenAI's
# Responses APIs, which the replicas translate into a chat request (the same translation is used here).
PromptKind = Literal["chat", "completion", "messages", "responses"]
PATHS: dict[str, PromptKind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                                "/v1/messages": "messages", "/v1/responses": "responses"}

# Bodies whose tokenization must agree between the router's tokenizer and a replica's before it is used.
PROBES: tuple[dict[str, Any], ...] = (
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there, 2+2?"},
                  {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 × 3 — é?"}]},
    {"prompt": "The quick brown fox\njumps over  the lazy dog."},
)


def prompt_kind(path: str) -> PromptKind | None:
    """What kind of prompt an HTTP endpoint takes; None for endpoints the router does not tokenize."""
    return PATHS.get(path)


def chat_request(kind: PromptKind, body: dict[str, Any]) -> ChatCompletionRequest | None:
    """The chat request a replica generates for `body` (None for a completion); raises InvalidRequest."""
    if kind == "chat":
        return parse_object(ChatCompletionRequest, body)
    if kind == "messages":
        return messages_chat_body(parse_object(MessagesRequest, body))
    if kind == "responses":
        return responses_chat_body(parse_object(ResponsesRequest, body))
    return None


def ws_request(message: dict[str, Any]) -> tuple[PromptKind, dict[str, Any]]:
    """The endpoint a /v1/ws generate message asks for, and its request fields (the replicas' own rule)."""
    chat, body = generate_fields(message)
    return ("chat" if chat else "completion"), body


def probe_kind(body: dict[str, Any]) -> PromptKind:
    return "chat" if "messages" in body else "completion"


def local_prompt_ids(kind: PromptKind, body: dict[str, Any], tokenizer: TokenizerLike) -> list[int] | None:
    """The prompt ids a replica with this tokenizer computes for `body` (with the default tool and reasoning
    options); None if it would refuse it."""
    try:
        chat = chat_request(kind, body)
        if chat is not None:
            return generation_prompt_ids(chat, tokenizer, tool_request(chat))[0]
        return generation_prompt_ids(parse_object(CompletionRequest, body), tokenizer)[0]  # a batch routes by its first
    except (InvalidRequest, TypeError, ValueError, KeyError, AttributeError):
        return None


def token_id_prompt(kind: PromptKind, body: dict[str, Any]) -> list[int] | None:
    """A completion prompt given as token ids needs no tokenizer."""
    if kind != "completion":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


def tokenize_request(kind: PromptKind, body: dict[str, Any], model: str | None) -> dict[str, Any] | None:
    """The POST /tokenize body that makes a replica tokenize `body`'s prompt as its generation would (its
    /tokenize takes no tools: for a request with tools this is an approximation)."""
    out: dict[str, Any] = {} if model is None else {"model": model}
    if kind != "completion":
        try:
            chat = chat_request(kind, body)
        except (InvalidRequest, TypeError, ValueError, KeyError, AttributeError):
            return None
        if chat is None:
            return None
        out["messages"] = [m.model_dump(mode="json", by_alias=True, exclude_none=True) for m in chat.messages]
        if chat.chat_template_kwargs is not None:
            out["chat_template_kwargs"] = chat.chat_template_kwargs
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    out.update(prompt=prompt, add_special_tokens=True)
    return out
