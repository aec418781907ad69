"""The HTTP routes of Anthropic's Messages API, for coding agents: validate, translate (translate.py), generate
through chat completions' path (openai/submit.py), render the output events. Errors take Anthropic's shape."""

from __future__ import annotations

from quart import Response
from pydantic import BaseModel
from quart_trio import QuartTrio

from trillm.web.anthropic.schema import CountTokensRequest, MessagesRequest
from trillm.web.anthropic.translate import MESSAGES_PATH, MessageTranslator, MessagesStream, anthropic_error, chat_body
from trillm.web.chat.output_events import ChoiceParser
from trillm.web.config import ServerConfig
from trillm.web.http.body import body_work, event_stream_response, json_body, json_response, large_body, started
from trillm.web.http.guards import register_error_shape
from trillm.web.http.sse import event_stream
from trillm.web.openai.submit import prepare_generation, start_generation
from trillm.web.openai.translation import FitMaxTokens
from trillm.web.service.registry import ModelRegistry

# The request bodies of these routes, for /openapi.json.
MESSAGES_ROUTES: tuple[tuple[str, type[BaseModel]], ...] = (
    (MESSAGES_PATH, MessagesRequest), (MESSAGES_PATH + "/count_tokens", CountTokensRequest))


def register_anthropic(app: QuartTrio, registry: ModelRegistry, config: ServerConfig) -> None:
    register_error_shape(app, MESSAGES_PATH, anthropic_error)

    @app.post(MESSAGES_PATH)
    async def messages() -> Response:
        body = await json_body(MessagesRequest)
        service = registry.select(body.model)
        fit = FitMaxTokens(body.max_tokens)
        chat = await body_work(lambda: chat_body(body))
        req, handle, _ = await start_generation(service, chat, config, adjust=fit, large=await large_body())
        translator = MessageTranslator(
            model=req.model, prompt_tokens=len(req.prompt_token_ids), stop_sequences=body.stop_sequences,
            context_limited=fit.context_limited(req, config.limits.max_tokens_limit))
        stream = MessagesStream(translator, ChoiceParser(req.parsing))
        if body.stream:
            events = event_stream(handle, stream, keepalive_s=config.sse_keepalive_s)
            return event_stream_response(await started(events))
        await handle.drain(stream.feed)
        return json_response(translator.message())

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens() -> Response:
        body = await json_body(CountTokensRequest)
        service = registry.select(body.model)
        chat = await body_work(lambda: chat_body(body))
        req, _ = await prepare_generation(service, chat, config, large=await large_body())
        return json_response({"input_tokens": len(req.prompt_token_ids)})
