"""Typed errors the engine raises. The web layer maps each to an HTTP status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for every error trillm's engine raises on purpose."""


class InvalidRequest(EngineError, ValueError):
    """The request can never be served as given (bad parameter, prompt too long, ...). HTTP 400."""


class Overloaded(EngineError):
    """The waiting queue is full; retry later. HTTP 503 with Retry-After."""


class UnknownRequest(EngineError, KeyError):
    """No live request has this id."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "unknown request"


class ModelLoadError(EngineError):
    """The model could not be loaded."""


class ModelNotFound(ModelLoadError, FileNotFoundError):
    """No model at that path (and not a reachable Hugging Face repo id)."""


class CorruptModelFile(ModelLoadError, ValueError):
    """The model file exists but cannot be read: truncated, corrupt, or an unsupported layout."""


class UnsupportedModel(ModelLoadError, ValueError):
    """The model loads, but the paged engine cannot serve it (yet): refused at load, in one line."""


class UnverifiedModel(ModelLoadError, ValueError):
    """The load-time probe found the paged forward disagreeing with mlx-lm's own forward of the same model."""
