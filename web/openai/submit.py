"""Starting a generation from a chat or completion body (every API surface translates to one): loading the
model, parsing off the event loop when that is slow, the request's deadline, its trace, and the submission."""

from __future__ import annotations

import math
from collections.abc import Callable

import trio
from quart import g, has_request_context, request
from werkzeug.datastructures import Headers

from trillm.engine.errors import InvalidRequest, Overloaded
from trillm.engine.tokenizer import TokenizerLike
from trillm.web.config import ServerConfig
from trillm.web.errors import APIError
from trillm.web.openai.request import (
    GenerationRequest, check_response_size, needs_grammar, parse_generation, prompt_bytes,
)
from trillm.web.openai.schema import ChatCompletionRequest, CompletionRequest
from trillm.web.service import tracing
from trillm.web.service.engine_service import EngineService, EngineUnavailable
from trillm.web.service.registry import ready_tokenizer
from trillm.web.service.stream import GenerationHandle


# Prompts this large are templated and tokenized on a worker thread, so the event loop keeps serving streams.
OFF_THREAD_PROMPT_BYTES = 16 << 10  # (the tokenizers are thread-safe)


async def prepare_generation(
    service: EngineService, body: ChatCompletionRequest | CompletionRequest, config: ServerConfig, *,
    adjust: Callable[[GenerationRequest], GenerationRequest] | None = None, large: bool = False,
) -> tuple[GenerationRequest, TokenizerLike]:
    """Load the model if need be, then parse `body` for it; `adjust` may change the parsed request (once its
    prompt length is known). `large`: the body was large (its size guard, template and tokenizer run off the
    event loop whatever it turns out to hold)."""
    await service.ensure_loaded()
    tokenizer = ready_tokenizer(service)
    limits = service.limits
    assert limits is not None  # set once the model is ready
    name = service.model_name

    def parse() -> GenerationRequest:
        req = parse_generation(body, name, tokenizer, limits, config.limits, config.chat_options)
        req = req if adjust is None else adjust(req)
        check_response_size(req, config.limits)  # once max_tokens is final
        return req

    # Compiling a grammar takes milliseconds (the first one for a tokenizer, about a second): off the loop.
    # (needs_grammar first: with tools, counting their schemas' bytes is itself work for the thread.)
    slow = large or needs_grammar(body) or prompt_bytes(body) > OFF_THREAD_PROMPT_BYTES
    req = await trio.to_thread.run_sync(parse) if slow else parse()
    return req, tokenizer


REQUEST_TIMEOUT_HEADER = "X-Request-Timeout"


def request_deadline(config: ServerConfig, headers: Headers | None) -> float | None:
    """The trio time by which a request must be done: --request-timeout, or the client's X-Request-Timeout
    (seconds) when that is sooner (a client may shorten the server's deadline, never lengthen it)."""
    timeout = config.request_timeout_s
    raw = headers.get(REQUEST_TIMEOUT_HEADER) if headers is not None else None
    if raw is not None:
        try:
            asked = float(raw)
        except ValueError:
            asked = math.nan
        if not 0 < asked < math.inf:
            raise APIError(400, f"{REQUEST_TIMEOUT_HEADER} must be a number of seconds > 0, got {raw[:40]!r}",
                           "invalid_request_error", "invalid_request_timeout")
        timeout = asked if timeout is None else min(timeout, asked)
    return None if timeout is None else trio.current_time() + timeout


async def start_generation(
    service: EngineService, body: ChatCompletionRequest | CompletionRequest, config: ServerConfig, *,
    adjust: Callable[[GenerationRequest], GenerationRequest] | None = None, large: bool = False,
) -> tuple[GenerationRequest, GenerationHandle, TokenizerLike]:
    """Parse, submit and wait for the engine to take the request; typed errors (admission, the engine's own
    included) become 4xx/5xx before any byte is sent. The request's deadline (see `request_deadline`) covers
    loading and parsing too: past it before the submission, 504."""
    headers = request.headers if has_request_context() else None
    deadline = request_deadline(config, headers)
    trace = tracing.start_request(
        headers, **{"gen_ai.operation.name": "chat" if isinstance(body, ChatCompletionRequest) else "text_completion",
                    "gen_ai.request.model": service.model_name, "gen_ai.request.max_tokens": body.max_tokens,
                    "http.route": request.path if headers is not None else None, "trillm.stream": bool(body.stream),
                    # the key's name (--api-key-file), never the key
                    "trillm.api_key.name": g.get("trillm_api_key_name") if headers is not None else None})
    try:
        with trio.move_on_at(math.inf if deadline is None else deadline) as waited:
            req, tokenizer = await prepare_generation(service, body, config, adjust=adjust, large=large)
        if waited.cancelled_caught:
            raise APIError(504, "the request's deadline passed before its generation started (--request-timeout, "
                                f"{REQUEST_TIMEOUT_HEADER})", "server_error", "request_timeout")
        handle = service.submit_prompts(req.prompts, req.params, priority=req.priority, deadline=deadline,
                                        trace=trace)
    except BaseException as exc:
        if trace is not None:
            trace.fail(exc)
            trace.end()
        if isinstance(exc, (InvalidRequest, Overloaded, EngineUnavailable)):
            service.metrics.on_outcome("rejected")
        raise
    try:
        # The engine's verdict (its memory check runs on the engine thread): a refusal raises here, an HTTP
        # error before a stream's headers; what fails after it (a preempted request that cannot resume) is an
        # error in the stream.
        await handle.admitted()
    except BaseException:
        handle.close()
        raise
    return req, handle, tokenizer
