"""The HTTP route of OpenAI's Responses API (stateless), for coding agents: validate, translate (translate.py),
generate through chat completions' path (openai/submit.py), render the output events."""

from __future__ import annotations

from quart import Response
from pydantic import BaseModel
from quart_trio import QuartTrio

from trillm.web.chat.output_events import ChoiceParser
from trillm.web.config import ServerConfig
from trillm.web.http.body import body_work, event_stream_response, json_body, json_response, large_body, started
from trillm.web.http.sse import event_stream
from trillm.web.openai.submit import start_generation
from trillm.web.openai.translation import FitMaxTokens
from trillm.web.responses.schema import ResponsesRequest
from trillm.web.responses.translate import ResponseTranslator, ResponsesStream, chat_body
from trillm.web.service.registry import ModelRegistry

RESPONSES_PATH = "/v1/responses"
# The request body of this route, for /openapi.json.
RESPONSES_ROUTES: tuple[tuple[str, type[BaseModel]], ...] = ((RESPONSES_PATH, ResponsesRequest),)


def register_responses(app: QuartTrio, registry: ModelRegistry, config: ServerConfig) -> None:
    @app.post(RESPONSES_PATH)
    async def responses() -> Response:
        body = await json_body(ResponsesRequest)
        service = registry.select(body.model)
        fit = FitMaxTokens(body.max_output_tokens)
        chat = await body_work(lambda: chat_body(body))
        req, handle, _ = await start_generation(service, chat, config, adjust=fit, large=await large_body())
        translator = ResponseTranslator(body, model=req.model, prompt_tokens=len(req.prompt_token_ids))
        stream = ResponsesStream(translator, ChoiceParser(req.parsing))
        if body.stream:
            events = event_stream(handle, stream, keepalive_s=config.sse_keepalive_s)
            return event_stream_response(await started(events))
        await handle.drain(stream.feed)
        return json_response(translator.response())
