"""A request's prompt token ids, computed the way a replica computes them, for routing only.

The replica parses and validates every request itself (the router forwards the body untouched), so a prompt
the router cannot tokenize is simply routed without KV information; a wrong guess costs a cache miss, never
a wrong answer. Local tokenization uses the same functions as the replicas (web/protocol.py) with the same
tokenizer: loaded from the model's files (`--tokenizer PATH`), or the mock engine's, and in either case
checked once against the replica's own POST /tokenize before it is trusted.
"""

from __future__ import annotations

from typing import Any, Literal

from trillm.engine.errors import InvalidRequest
from trillm.engine.tokenizer import TokenizerLike
from trillm.web.openai_schema import ChatCompletionRequest, CompletionRequest, parse_object
from trillm.web.protocol import generation_prompt_ids, tool_request

PromptKind = Literal["chat", "completion"]

# Bodies whose tokenization must agree between the router's tokenizer and a replica's before it is used.
PROBES: tuple[dict[str, Any], ...] = (
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there, 2+2?"},
                  {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 × 3 — é?"}]},
    {"prompt": "The quick brown fox\njumps over  the lazy dog."},
)


def prompt_kind(path: str) -> PromptKind | None:
    """What kind of prompt an HTTP endpoint takes; None for endpoints the router does not tokenize."""
    if path == "/v1/chat/completions":
        return "chat"
    if path == "/v1/completions":
        return "completion"
    return None


def ws_request(message: dict[str, Any]) -> tuple[PromptKind, dict[str, Any]]:
    """The endpoint a /v1/ws generate message asks for, and its request fields (the same rule as web/ws.py)."""
    body = {k: v for k, v in message.items() if k not in ("type", "id", "endpoint")}
    endpoint = message.get("endpoint")
    return ("chat" if endpoint == "chat" or (endpoint is None and "messages" in body) else "completion"), body


def probe_kind(body: dict[str, Any]) -> PromptKind:
    return "chat" if "messages" in body else "completion"


def local_prompt_ids(kind: PromptKind, body: dict[str, Any], tokenizer: TokenizerLike) -> list[int] | None:
    """The prompt ids a replica with this tokenizer computes for `body` (with the default tool and reasoning
    options); None if it would refuse it."""
    try:
        if kind == "chat":
            chat = parse_object(ChatCompletionRequest, body)
            return generation_prompt_ids(chat, tokenizer, tool_request(chat))
        return generation_prompt_ids(parse_object(CompletionRequest, body), tokenizer)
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
    if kind == "chat":
        if "messages" not in body:
            return None
        out.update({k: body[k] for k in ("messages", "chat_template_kwargs") if k in body})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    out.update(prompt=prompt, add_special_tokens=True)
    return out
