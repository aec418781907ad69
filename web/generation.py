"""What the HTTP and websocket front ends share: choosing the model, and starting a generation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trillm.engine.errors import InvalidRequest, Overloaded
from trillm.web.config import ServerConfig
from trillm.web.errors import APIError
from trillm.web.protocol import GenerationRequest, Kind, parse_generation
from trillm.engine.tokenizer import TokenizerLike
from trillm.web.service import EngineService, EngineUnavailable, ServiceState
from trillm.web.stream import GenerationHandle


class ModelRegistry:
    """The served models, by name; the first one answers requests that name no model."""

    def __init__(self, services: Sequence[EngineService]) -> None:
        if not services:
            raise ValueError("serve at least one model")
        self.services = list(services)

    def select(self, model: object) -> EngineService:
        if model is None:
            return self.services[0]
        for service in self.services:
            if service.model_name == model:
                return service
        names = ", ".join(s.model_name for s in self.services)
        raise APIError(404, f"model {model!r} is not served here (served: {names})", "invalid_request_error",
                       "model_not_found", "model")


def ready_tokenizer(service: EngineService) -> TokenizerLike:
    if service.tokenizer is None or service.state is not ServiceState.READY:
        raise EngineUnavailable(f"model {service.model_name} is {service.state.value}; retry shortly")
    return service.tokenizer


async def any_tokenizer(service: EngineService) -> TokenizerLike:
    """The model's tokenizer: kept after an idle unload, otherwise the model is loaded first."""
    if service.tokenizer is None:
        await service.ensure_loaded()
    return ready_tokenizer(service) if service.tokenizer is None else service.tokenizer


async def start_generation(service: EngineService, body: dict[str, Any], kind: Kind,
                           config: ServerConfig) -> tuple[GenerationRequest, GenerationHandle, TokenizerLike]:
    """Parse and submit; typed errors (admission included) become 4xx/5xx before any byte is sent."""
    try:
        await service.ensure_loaded()
        tokenizer = ready_tokenizer(service)
        req = parse_generation(body, kind, service.model_name, tokenizer, service.max_model_len, config.limits)
        handle = service.submit(req.prompt_token_ids, req.params, priority=req.priority)
    except (InvalidRequest, Overloaded, EngineUnavailable):
        service.metrics.on_outcome("rejected")
        raise
    return req, handle, tokenizer
