"""The HTTP routes of OpenAI's API (chat and text completions, the model list) and vLLM's tokenizer routes."""

from __future__ import annotations

import trio
from quart import Response, request
from quart_trio import QuartTrio

from trillm.web.config import ServerConfig
from trillm.web.errors import APIError
from trillm.web.http.body import event_stream_response, json_body, json_response, large_body, started
from trillm.web.openai.request import chat_prompt_ids
from trillm.web.openai.response import response_builder, sse_stream
from trillm.web.openai.schema import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from trillm.web.openai.submit import start_generation
from trillm.web.service.registry import ModelRegistry, any_tokenizer


def register_openai(app: QuartTrio, registry: ModelRegistry, config: ServerConfig) -> None:
    async def generate(body: ChatCompletionRequest | CompletionRequest) -> Response:
        service = registry.select(body.model)
        req, handle, tokenizer = await start_generation(service, body, config, large=await large_body())
        builder = response_builder(req, handle.request_ids, tokenizer)
        if req.stream:
            return event_stream_response(await started(sse_stream(handle, builder, keepalive_s=config.sse_keepalive_s)))
        await handle.drain(builder.add)
        return json_response(builder.response())

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate(await json_body(ChatCompletionRequest))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate(await json_body(CompletionRequest))

    @app.get("/v1/models")
    async def models() -> Response:
        # OpenAI's list, with the fields Anthropic's clients read (type, display_name, created_at, has_more).
        data = [{"id": s.model_name, "object": "model", "created": 0, "owned_by": "trillm",
                 "type": "model", "display_name": s.model_name, "created_at": "1970-01-01T00:00:00Z",
                 "max_model_len": s.max_model_len, "ready": s.healthy} for s in registry.services]
        return json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": data[0]["id"], "last_id": data[-1]["id"]})

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = await json_body(TokenizeRequest)
        service = registry.select(body.model)
        tokenizer = await any_tokenizer(service)
        if body.messages is not None:
            messages = body.messages
            ids = await trio.to_thread.run_sync(lambda: chat_prompt_ids(messages, tokenizer,
                                                           template_kwargs=body.chat_template_kwargs))
        elif body.prompt is not None:
            prompt = body.prompt
            ids = await trio.to_thread.run_sync(lambda: tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens))
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages'")
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": service.max_model_len})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        # What a client that tokenizes through /tokenize and /detokenize needs (lm-eval's remote tokenizer).
        service = registry.select(request.args.get("model"))
        tokenizer = await any_tokenizer(service)
        special = tokenizer.special_tokens
        return json_response({"eos_token": special.eos_token, "bos_token": special.bos_token,
                              "pad_token": special.pad_token, "chat_template": special.chat_template,
                              "model_max_length": service.max_model_len, "vocab_size": tokenizer.vocab_size})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        body = await json_body(DetokenizeRequest)
        service = registry.select(body.model)
        tokenizer = await any_tokenizer(service)
        if any(t >= tokenizer.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})")
        tokens = body.tokens
        return json_response({"prompt": await trio.to_thread.run_sync(lambda: tokenizer.decode(tokens, skip_special_tokens=False))})
