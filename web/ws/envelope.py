"""The /v1/ws envelope, shared by a replica (web/ws/session.py) and the router (web/router/ws.py), so both read a
message the same way: what one accepts the other accepts, and an error names the same generation.

Messages are parsed with pydantic's JSON parser, as HTTP bodies are: no lone surrogates (a replica could not
encode them back), bounded nesting. When a message is refused as JSON, its id is still looked for with a
lenient parse, so the client can tell which generation the error belongs to.

Size: a client's message is bounded by --max-ws-message-bytes (the server's websocket limit); a server's
message by MAX_SEND_BYTES. A replica never sends more: a message that would be larger (a huge
`prompt_logprobs` delta) fails its own generation with `message_too_large`; the router's upstream sockets
accept exactly that much, so no message can close a socket that other generations share.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

import pydantic_core

from trillm.web.errors import APIError

MAX_SEND_BYTES = 16 << 20  # the largest message a replica sends (and the router accepts from one)


class BadMessage(Exception):
    """A message refused before it names a generation; `gid` is the id to answer with (None if unknown)."""

    def __init__(self, gid: object, error: APIError) -> None:
        super().__init__(error.message)
        self.gid = gid
        self.error = error


def _lenient_id(raw: str | bytes) -> str | int | None:
    """The id of a message the strict parser refused, if the stdlib parser finds a usable one."""
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    gid = msg.get("id") if isinstance(msg, dict) else None
    if isinstance(gid, bool) or not isinstance(gid, (str, int)):
        return None
    if isinstance(gid, str):
        try:
            gid.encode()
        except UnicodeEncodeError:  # itself a lone surrogate: it could not be sent back
            return None
    return gid


def parse_message(raw: str | bytes) -> tuple[dict[str, Any], str | int]:
    """The message and its id; BadMessage if it is not a JSON object with a string or integer id."""
    try:
        msg = pydantic_core.from_json(raw)
    except ValueError as exc:
        raise BadMessage(_lenient_id(raw), APIError(400, f"the message is not valid JSON: {exc}")) from None
    if not isinstance(msg, dict):
        raise BadMessage(None, APIError(400, "a message must be a JSON object"))
    gid = msg.get("id")
    if not isinstance(gid, (str, int)) or isinstance(gid, bool):
        raise BadMessage(gid, APIError(400, "a message needs an 'id' (string or integer)"))
    return msg, gid


def refusal(msg: dict[str, Any], gid: str | int, active: Collection[str], max_generations: int) -> APIError | None:
    """Why a socket with the generations `active` (by str(id)) refuses this message; None if it takes it."""
    kind, key = msg.get("type"), str(gid)
    if kind == "cancel" and key not in active:
        return APIError(404, f"no running generation has id {gid!r}", code="generation_not_found")
    if kind == "generate" and key in active:
        return APIError(400, f"a generation with id {gid!r} is already running")
    if kind == "generate" and len(active) >= max_generations:
        return APIError(429, "too many concurrent generations on this socket")
    return None if kind in ("generate", "cancel") else APIError(400, "'type' must be 'generate' or 'cancel'")


def generate_fields(msg: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """A generate message's request fields, and whether they are a chat (endpoint "chat", or "messages"
    without an endpoint) rather than a completion."""
    fields = {k: v for k, v in msg.items() if k not in ("type", "id", "endpoint")}
    endpoint = msg.get("endpoint")
    return endpoint == "chat" or (endpoint is None and "messages" in fields), fields


def encode_message(msg: dict[str, Any]) -> str:
    """A server's message as text; APIError (for its generation alone) if it is over MAX_SEND_BYTES."""
    text = json.dumps(msg, separators=(",", ":"), ensure_ascii=False)
    if 4 * len(text) > MAX_SEND_BYTES and (size := len(text.encode())) > MAX_SEND_BYTES:
        raise APIError(400, f"this generation's next websocket message would be {size} bytes, over the "
                            f"{MAX_SEND_BYTES >> 20} MiB bound; ask for fewer prompt_logprobs or top_logprobs",
                       code="message_too_large")
    return text
