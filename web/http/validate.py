"""Request bodies validated against their declared (pydantic) models; a failure names the first bad field."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from trillm.engine.errors import InvalidRequest

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
