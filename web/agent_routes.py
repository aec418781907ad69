"""The HTTP routes of Anthropic's Messages API and OpenAI's Responses API, for coding agents.

Thin: validate the body, translate it (anthropic_api.py, responses_api.py), generate through chat
completions' own path (generation.py), render what comes back. Errors on /v1/messages take Anthropic's shape
(app.py's handlers ask `anthropic_path`).
"""

from __future__ import annotations

import trio
from quart import Response
from pydantic import BaseModel
from quart_trio import QuartTrio

from trillm.web import anthropic_api, responses_api
from trillm.web.anthropic_schema import CountTokensRequest, MessagesRequest
from trillm.web.config import ServerConfig
from trillm.web.generation import ModelRegistry, prepare_generation, start_generation
from trillm.web.http import body_work, event_stream_response, json_body, json_response, large_body, started
from trillm.web.responses_schema import ResponsesRequest
from trillm.web.sse import event_stream
from trillm.web.stream import GenerationHandle
from trillm.web.output_events import ChoiceParser
from trillm.web.translation import FitMaxTokens, choice_events

# The request bodies of these routes, for /openapi.json.
AGENT_ROUTES: tuple[tuple[str, type[BaseModel]], ...] = (
    ("/v1/messages", MessagesRequest), ("/v1/messages/count_tokens", CountTokensRequest),
    ("/v1/responses", ResponsesRequest))

MESSAGES_PATH = "/v1/messages"


def anthropic_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


async def _collect(handle: GenerationHandle, parser: ChoiceParser,
                   translator: anthropic_api.MessageTranslator | responses_api.ResponseTranslator) -> None:
    """Feed a whole non-streamed generation through its translator."""
    with handle:
        while True:
            try:
                out = await handle.receive()
            except trio.EndOfChannel:
                return
            translator.feed(choice_events(parser, out), out.usage)


def register_agent_apis(app: QuartTrio, registry: ModelRegistry, config: ServerConfig) -> None:
    keepalive_s = config.sse_keepalive_s

    @app.post(MESSAGES_PATH)
    async def messages() -> Response:
        body = await json_body(MessagesRequest)
        service = registry.select(body.model)
        fit = FitMaxTokens(body.max_tokens)
        chat = await body_work(lambda: anthropic_api.chat_body(body))
        req, handle, _ = await start_generation(service, chat, config, adjust=fit, large=await large_body())
        translator = anthropic_api.MessageTranslator(
            model=req.model, prompt_tokens=len(req.prompt_token_ids), stop_sequences=body.stop_sequences,
            context_limited=fit.context_limited(req, config.limits.max_tokens_limit))
        parser = ChoiceParser(req.parsing)
        if body.stream:
            stream = anthropic_api.MessagesStream(translator, parser)
            return event_stream_response(await started(event_stream(handle, stream, keepalive_s=keepalive_s)))
        await _collect(handle, parser, translator)
        return json_response(translator.message())

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens() -> Response:
        body = await json_body(CountTokensRequest)
        service = registry.select(body.model)
        chat = await body_work(lambda: anthropic_api.chat_body(body))
        req, _ = await prepare_generation(service, chat, config, large=await large_body())
        return json_response({"input_tokens": len(req.prompt_token_ids)})

    @app.post("/v1/responses")
    async def responses() -> Response:
        body = await json_body(ResponsesRequest)
        service = registry.select(body.model)
        fit = FitMaxTokens(body.max_output_tokens)
        chat = await body_work(lambda: responses_api.chat_body(body))
        req, handle, _ = await start_generation(service, chat, config, adjust=fit, large=await large_body())
        translator = responses_api.ResponseTranslator(body, model=req.model, prompt_tokens=len(req.prompt_token_ids))
        parser = ChoiceParser(req.parsing)
        if body.stream:
            stream = responses_api.ResponsesStream(translator, parser)
            return event_stream_response(await started(event_stream(handle, stream, keepalive_s=keepalive_s)))
        await _collect(handle, parser, translator)
        return json_response(translator.response())
