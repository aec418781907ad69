"""The served models by name, and their tokenizers."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from trillm.engine.tokenizer import TokenizerLike
from trillm.web.service.engine_service import EngineService, ServiceState


class ModelNotFound(LookupError):
    """A request named a model this server does not serve (HTTP 404)."""


class ModelRegistry:
    """The served models, by name; the first one answers requests that name no model.

    `aliases` are (pattern, served name) pairs, tried in order after the served names themselves: a pattern
    is a name or a shell glob (`claude-*`), so agents that send their own model names reach a served model.
    """

    def __init__(self, services: Sequence[EngineService], aliases: Sequence[tuple[str, str]] = ()) -> None:
        if not services:
            raise ValueError("serve at least one model")
        self.services = list(services)
        self.aliases = tuple(aliases)
        served = {s.model_name for s in self.services}
        for pattern, target in self.aliases:
            if target not in served:
                raise ValueError(f"--model-alias {pattern}={target}: no served model is named {target!r} "
                                 f"(served: {', '.join(sorted(served))})")

    async def wait_drained(self) -> None:
        """Until a graceful shutdown has ended every live request (see EngineService.drain)."""
        for service in self.services:
            await service.wait_drained()

    def select(self, model: object) -> EngineService:
        if model is None:
            return self.services[0]
        for service in self.services:
            if service.model_name == model:
                return service
        if isinstance(model, str):
            for pattern, target in self.aliases:
                if fnmatch.fnmatchcase(model, pattern):
                    for service in self.services:
                        if service.model_name == target:
                            return service
        names = ", ".join(s.model_name for s in self.services)
        raise ModelNotFound(f"model {model!r} is not served here (served: {names})")


def ready_tokenizer(service: EngineService) -> TokenizerLike:
    if service.tokenizer is None or service.state is not ServiceState.READY:
        raise service.unavailable()
    return service.tokenizer


async def any_tokenizer(service: EngineService) -> TokenizerLike:
    """The model's tokenizer: kept after an idle unload, otherwise the model is loaded first."""
    if service.tokenizer is None:
        await service.ensure_loaded()
    return ready_tokenizer(service) if service.tokenizer is None else service.tokenizer
