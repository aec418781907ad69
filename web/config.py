"""The web layer's one frozen config."""

from __future__ import annotations

from dataclasses import dataclass

from trillm.web.protocol import Limits


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The web layer's knobs; each cap on what one request may ask has a `trillm serve` flag (README)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer auth on /v1/*, /tokenize, /detokenize and the websockets when set
    max_request_bytes: int = 4 << 20  # HTTP bodies
    max_ws_message_bytes: int = 1 << 20  # one websocket message
    max_prompt_bytes: int = 1 << 20  # text to template and tokenize, checked before either
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024
    sse_keepalive_s: float = 5.0  # comment lines while a stream waits or prefills
    backlog: int = 4096  # listen queue: a burst of clients connecting at once is not refused
    keep_alive_timeout_s: float = 5.0
    graceful_timeout_s: float = 3.0
    max_ws_generations: int = 64  # concurrent generations on one websocket
    max_ws_requests: int = 64  # concurrent engine requests on one websocket, counting each of n choices
    allowed_origins: tuple[str, ...] = ()  # web pages (besides the server's own) that may open its websockets

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1024 or self.max_ws_message_bytes < 1024:
            raise ValueError("max_request_bytes and max_ws_message_bytes must be >= 1024")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.sse_keepalive_s <= 0:
            raise ValueError("sse_keepalive_s must be > 0")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        self.limits  # validates the caps

    @property
    def limits(self) -> Limits:
        return Limits(max_prompt_tokens=self.max_prompt_tokens, max_tokens_limit=self.max_tokens_limit,
                      max_n=self.max_n, max_stop_strings=self.max_stop_strings,
                      max_stop_string_chars=self.max_stop_string_chars, max_stop_token_ids=self.max_stop_token_ids,
                      max_logit_bias=self.max_logit_bias, max_prompt_bytes=self.max_prompt_bytes)
