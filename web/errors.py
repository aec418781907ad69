"""OpenAI's JSON error shape, and the mapping from trillm's typed errors to HTTP status codes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trillm.engine.errors import InvalidRequest, ModelLoadError, Overloaded
from trillm.web.service.engine_service import EngineUnavailable
from trillm.web.service.registry import ModelNotFound
from trillm.web.service.stream import GenerationFailed


@dataclass(frozen=True, slots=True)
class APIError(Exception):
    """An error the client sees as `{"error": {...}}` with `status`; never carries a traceback."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def to_api_error(exc: BaseException, *, retry_after: int = 1) -> APIError:
    """Map a typed error to what the client sees. Unknown errors become an opaque 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), "invalid_request_error", "invalid_request")
    if isinstance(exc, ModelNotFound):
        return APIError(404, str(exc), "invalid_request_error", "model_not_found", "model")
    if isinstance(exc, Overloaded):
        return APIError(503, str(exc), "server_error", "overloaded", headers={"Retry-After": str(retry_after)})
    if isinstance(exc, EngineUnavailable):
        wait = max(1, math.ceil(exc.retry_after_s))
        return APIError(503, str(exc), "server_error", exc.code, headers={"Retry-After": str(wait)})
    if isinstance(exc, GenerationFailed):
        return APIError(500, str(exc), "server_error", "generation_failed")
    if isinstance(exc, ModelLoadError):
        return APIError(500, f"the model could not be loaded: {exc}", "server_error", "model_load_failed")
    return APIError(500, "internal server error", "server_error", "internal_error")
