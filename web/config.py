"""The web layer's one frozen config."""

from __future__ import annotations

from dataclasses import dataclass

from trillm.web.chat.features import ChatOptions
from trillm.web.http.keys import ApiKey
from trillm.web.openai.request import Limits


class ServeError(Exception):
    """The server cannot start as configured (a busy port, two models under one name): one clear line."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The web layer's knobs; each cap has a `trillm serve` flag (README lists them with their defaults)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer auth on /v1/*, /tokenize, /detokenize and the websockets when set
    # A router's own key: when set, /internal/* takes only it (and the API takes it too, for the router's
    # proxying), so API users cannot read which prompts are cached (see `reveals_block_hashes`).
    internal_api_key: str | None = None
    limits: Limits = Limits()  # what one request may ask for
    max_request_bytes: int = 4 << 20  # HTTP bodies
    max_ws_message_bytes: int = 1 << 20  # one websocket message
    max_ws_generations: int = 64  # concurrent generations on one websocket
    max_ws_requests: int = 64  # concurrent engine requests on one websocket, counting each of n choices
    sse_keepalive_s: float = 5.0  # comment lines while a stream waits or prefills
    backlog: int = 4096  # listen queue: a burst of clients connecting at once is not refused
    # hypercorn counts a fresh connection as idle until its first request, and HTTP clients keep idle
    # connections for reuse (httpx: 5 s): a timeout that short closed connections whose request was on its
    # way (a loaded client, or a reused connection), without any response. Longer than any client's expiry.
    keep_alive_timeout_s: float = 75.0
    drain_timeout_s: float = 10.0  # on SIGTERM: open requests may finish for this long, then end with an error
    allowed_origins: tuple[str, ...] = ()  # web pages (besides the server's own) that may open its websockets
    tool_parser: str | None = None  # the tool-call format (web/chat/tool_parsers.py); None: detected per model
    reasoning_parser: str | None = None  # the reasoning markers (web/chat/reasoning.py); None: detected; "none": off
    model_aliases: tuple[tuple[str, str], ...] = ()  # (name or glob, served model name), tried in order
    # A request's deadline in seconds (its X-Request-Timeout header may ask for less): past it the generation
    # ends with finish reason "timeout" and its blocks are freed. None: no deadline unless the client asks.
    request_timeout_s: float | None = None
    api_keys: tuple[ApiKey, ...] = ()  # --api-key-file's named keys, each with its limits (web/http/keys.py)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1024 or self.max_ws_message_bytes < 1024:
            raise ValueError("max_request_bytes and max_ws_message_bytes must be >= 1024")
        if self.sse_keepalive_s <= 0:
            raise ValueError("sse_keepalive_s must be > 0")
        if self.drain_timeout_s < 0 or self.keep_alive_timeout_s <= 0:
            raise ValueError("drain_timeout_s must be >= 0 and keep_alive_timeout_s > 0")
        if self.request_timeout_s is not None and not 0 < self.request_timeout_s < float("inf"):
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.api_key == "" or self.internal_api_key == "":
            raise ValueError("api_key and internal_api_key must not be empty")
        self.chat_options  # validates the parser names

    @property
    def reveals_block_hashes(self) -> bool:
        """Whether /internal/kv-events may give its subscribers the engine's block hashes (and the seed they
        chain from): with them, anyone can hash a guessed prompt and watch whether it is cached. Only to the
        holders of an internal key, or on a server with no key at all (where anyone may do anything)."""
        return self.internal_api_key is not None or self.api_key is None

    @property
    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.tool_parser, self.reasoning_parser)
