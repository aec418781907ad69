"""OpenAI's JSON error shape, the mapping from trillm's typed errors to HTTP status codes, and request bodies
validated against their declared (pydantic) models (a failure names the first bad field)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

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


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], data: bytes | str) -> M:
    """Validate a raw JSON body against `model`; InvalidRequest (HTTP 400) names the first bad field."""
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise InvalidRequest(describe(exc)) from None


def parse_object(model: type[M], obj: Any) -> M:
    """Validate an already-decoded JSON object (a websocket message) against `model`."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise InvalidRequest(describe(exc)) from None


def describe(exc: ValidationError) -> str:
    """The first error as one line a client can act on: the field path, then what is wrong with it."""
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    # Of a union's alternatives, the one that got furthest into the value says most ("stop.0: at least 1
    # character" rather than "stop: not a string").
    err = max(errors, key=lambda e: len(e["loc"]))
    if err["type"] == "json_invalid":
        return f"the request body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}"
    # Drop pydantic's union-branch labels ("str", "list[int]", ...) from the path: clients never wrote them.
    path = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES)))
    return f"'{path}': {err['msg']}" if path else err["msg"]


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after", "constrained-str",
                         "constrained-int", "constrained-float"})
