"""OpenAI wire format: request bodies -> prompt ids and SamplingParams; deltas -> responses and chunks.

Pure functions and small records, no IO, so every rule here is testable without a server.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from trillm.engine.errors import InvalidRequest
from trillm.engine.outputs import FinishReason, RequestOutput, TokenLogprob, Usage
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.tokenizer import TokenizerLike as Tokenizer

Kind = Literal["chat", "completion"]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@dataclass(frozen=True, slots=True)
class Limits:
    """Server-side limits on what one request may ask for."""

    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_n: int = 16


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One parsed /v1/chat/completions or /v1/completions body."""

    kind: Kind
    model: str
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # one per choice (n)
    stream: bool
    include_usage: bool
    logprobs: bool
    priority: int = 0


# ---- parsing ----

def _bad(message: str) -> InvalidRequest:
    return InvalidRequest(message)


def _get(body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _bad(f"'{key}' must be of type {_type_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise _bad(f"'{key}' must be of type {_type_names(types)}, got {type(value).__name__}")
    return value


def _type_names(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def _text_of(content: Any) -> str:
    """A message's content: a string, or OpenAI content parts of which only text is supported."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad("message 'content' must be a string or a list of content parts")


def chat_prompt_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """Apply the model's chat template to `messages` (and `tools`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list")
    normalized = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad("each message must be an object with a string 'role'")
        normalized.append({**m, "content": _text_of(m.get("content"))})
    tools = _get(body, "tools", list)
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    try:
        return list(tokenizer.apply_chat_template(normalized, tools=tools, add_generation_prompt=True, **kwargs))
    except InvalidRequest:
        raise
    except Exception as exc:  # template errors are the request's fault (e.g. a role it does not allow)
        raise _bad(f"the chat template could not be applied: {exc}") from exc


def completion_prompt_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise _bad("prompt token ids must be in [0, vocab_size)")
        return list(prompt)
    raise _bad("'prompt' must be a string or a list of token ids (batches of several prompts are not supported)")


def sampling_params(body: dict[str, Any], kind: Kind, prompt_len: int, max_model_len: int,
                    limits: Limits) -> list[SamplingParams]:
    """Every sampling parameter the engine has, with OpenAI's names; one SamplingParams per choice."""
    n = _get(body, "n", int, 1)
    if not 1 <= n <= limits.max_n:
        raise _bad(f"'n' must be in [1, {limits.max_n}]")
    max_tokens = _get(body, "max_completion_tokens", int) or _get(body, "max_tokens", int)
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if kind == "completion" else max(1, max_model_len - prompt_len)
        if limits.max_tokens_limit is not None:
            max_tokens = min(max_tokens, limits.max_tokens_limit)
    elif limits.max_tokens_limit is not None and max_tokens > limits.max_tokens_limit:
        raise _bad(f"max_tokens is {max_tokens}; this server allows at most {limits.max_tokens_limit}")
    stop = _get(body, "stop", (str, list), [])
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if kind == "chat":
        logprobs = bool(_get(body, "logprobs", bool, False))
        top_logprobs = _get(body, "top_logprobs", int, 0)
        if top_logprobs and not logprobs:
            raise _bad("'top_logprobs' requires 'logprobs': true")
    else:
        lp = _get(body, "logprobs", int)
        logprobs, top_logprobs = lp is not None, lp or 0
    bias = _get(body, "logit_bias", dict, {})
    try:
        logit_bias = tuple((int(k), float(v)) for k, v in bias.items())
    except (TypeError, ValueError) as exc:
        raise _bad("'logit_bias' maps token ids to numbers") from exc
    response_format = _get(body, "response_format", dict)
    if response_format and response_format.get("type", "text") != "text":
        raise _bad("response_format other than 'text' is not supported")
    seed = _get(body, "seed", int)
    common: dict[str, Any] = dict(
        max_tokens=max_tokens,
        min_tokens=_get(body, "min_tokens", int, 0),
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        top_k=_get(body, "top_k", int, 0),
        min_p=float(_get(body, "min_p", (int, float), 0.0)),
        repetition_penalty=float(_get(body, "repetition_penalty", (int, float), 1.0)),
        presence_penalty=float(_get(body, "presence_penalty", (int, float), 0.0)),
        frequency_penalty=float(_get(body, "frequency_penalty", (int, float), 0.0)),
        logit_bias=logit_bias,
        stop=stop,
        stop_token_ids=tuple(_get(body, "stop_token_ids", list, [])),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        skip_special_tokens=bool(_get(body, "skip_special_tokens", bool, True)),
        include_stop_str_in_output=bool(_get(body, "include_stop_str_in_output", bool, False)),
    )
    # Choice i gets seed + i: reproducible, yet the n choices differ.
    return [SamplingParams(seed=None if seed is None else seed + i, **common) for i in range(n)]


def parse_generation(body: dict[str, Any], kind: Kind, model: str, tokenizer: Tokenizer, max_model_len: int,
                     limits: Limits) -> GenerationRequest:
    """Validate a request body (raising InvalidRequest) and turn it into prompt ids and params."""
    if body.get("echo"):
        raise _bad("'echo' is not supported")
    ids = chat_prompt_ids(body, tokenizer) if kind == "chat" else completion_prompt_ids(body, tokenizer)
    if not ids:
        raise _bad("the prompt is empty")
    if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
        raise _bad(f"the prompt has {len(ids)} tokens; this server allows at most {limits.max_prompt_tokens}")
    params = sampling_params(body, kind, len(ids), max_model_len, limits)
    stream_options = _get(body, "stream_options", dict, {})
    return GenerationRequest(
        kind=kind, model=model, prompt_token_ids=ids, params=params,
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        logprobs=params[0].logprobs, priority=_get(body, "priority", int, 0),
    )


# ---- responses ----

def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


@dataclass(slots=True)
class _Choice:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class ResponseBuilder:
    """Accumulates one generation's deltas and renders OpenAI responses and stream chunks."""

    def __init__(self, req: GenerationRequest, request_ids: tuple[str, ...], tokenizer: Tokenizer) -> None:
        self.req = req
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if req.kind == "chat" else "text_completion"
        self.choices = [_Choice() for _ in request_ids]
        self._text_offset = [0] * len(request_ids)

    # -- logprobs in both formats --
    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, lps: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in lps:
            token, raw = self._token(lp.token_id)
            top = []
            for tid, val in lp.top:
                t, b = self._token(tid)
                top.append({"token": t, "logprob": val, "bytes": b})
            content.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, i: int, lps: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            token, _ = self._token(lp.token_id)
            tokens.append(token)
            values.append(lp.logprob)
            tops.append({self._token(tid)[0]: val for tid, val in lp.top} if lp.top else None)
            offsets.append(self._text_offset[i])
            self._text_offset[i] += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def logprobs_for(self, i: int, lps: tuple[TokenLogprob, ...] | list[TokenLogprob] | None) -> Any:
        if not self.req.logprobs or lps is None:
            return None
        return self._chat_logprobs(lps) if self.req.kind == "chat" else self._completion_logprobs(i, lps)

    def total_usage(self) -> Usage:
        usages = [c.usage for c in self.choices if c.usage is not None]
        if not usages:
            return Usage(len(self.req.prompt_token_ids), 0, 0)
        return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                     max(u.cached_tokens for u in usages))

    # -- non-streaming --
    def add(self, out: RequestOutput) -> int:
        i = self.index[out.request_id]
        c = self.choices[i]
        c.text += out.new_text
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        c.usage = out.usage
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason
        return i

    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            logprobs = self.logprobs_for(i, c.logprobs)
            if self.req.kind == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs, "finish_reason": _finish_reason(c.finish_reason)})
            else:
                choices.append({"index": i, "text": c.text, "logprobs": logprobs,
                                "finish_reason": _finish_reason(c.finish_reason)})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.req.model,
                "choices": choices, "usage": usage_dict(self.total_usage())}

    # -- streaming --
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object + ("" if self.req.kind == "completion" else ".chunk"),
                                 "created": self.created, "model": self.req.model, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunks(self) -> list[dict[str, Any]]:
        """The role chunk of each chat choice (completions have none)."""
        if self.req.kind != "chat":
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.choices))]

    def delta_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        i = self.add(out)
        chunks = []
        if out.new_text or out.logprobs:
            logprobs = self.logprobs_for(i, out.logprobs)
            if self.req.kind == "chat":
                choice = {"index": i, "delta": {"content": out.new_text}, "logprobs": logprobs, "finish_reason": None}
            else:
                choice = {"index": i, "text": out.new_text, "logprobs": logprobs, "finish_reason": None}
            chunks.append(self._chunk([choice]))
        if out.finish_reason is not None:
            fr = _finish_reason(out.finish_reason)
            if self.req.kind == "chat":
                choice = {"index": i, "delta": {}, "logprobs": None, "finish_reason": fr}
            else:
                choice = {"index": i, "text": "", "logprobs": None, "finish_reason": fr}
            chunks.append(self._chunk([choice]))
        return chunks

    def final_chunks(self) -> list[dict[str, Any]]:
        if not self.req.include_usage:
            return []
        chunk = self._chunk([])
        chunk["usage"] = usage_dict(self.total_usage())
        return [chunk]
