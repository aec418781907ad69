"""Several API keys with names (`--api-key-file`), each with its own limits: requests per minute and requests
in flight. A key is known by its name everywhere (logs, metric labels, traces); the key itself is only
hashed, never logged or exposed.

The file: one key per line, `NAME KEY [rpm=N] [concurrent=N]`; blank lines and `#` comments are skipped. A
key without its own limits gets the server's (`--key-rpm`, `--key-max-concurrent`; none by default).

Requests per minute is a token bucket (capacity rpm, refilled at rpm/60 per second, so a burst of rpm requests
is allowed and then one every 60/rpm seconds); a refusal says when the next token comes (Retry-After). In
flight counts each HTTP request from its admission until its response is complete, the whole stream for a
streamed one. Everything here runs on the trio thread; time is trio's clock.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:  # web/config.py imports this module: the app's side is imported where it is installed
    from quart import Response
    from quart_trio import QuartTrio

    from trillm.web.errors import APIError

log = logging.getLogger("trillm.web.http.keys")

_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


class KeyFileError(ValueError):
    """The key file cannot be used (one line saying where and why; never the key)."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: bytes  # sha256 of the key
    rpm: int | None = None  # requests per minute; None: unlimited
    max_concurrent: int | None = None  # requests in flight; None: unlimited


def _digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def parse_key_file(text: str, *, default_rpm: int | None = None,
                   default_concurrent: int | None = None) -> list[ApiKey]:
    keys: list[ApiKey] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) < 2:
            raise KeyFileError(f"line {lineno}: want 'NAME KEY [rpm=N] [concurrent=N]'")
        name, secret, *options = fields
        if not _NAME.match(name):
            raise KeyFileError(f"line {lineno}: a key's name is 1-64 of A-Z a-z 0-9 _ . @ -, got {name[:64]!r}")
        if len(secret) < 8:
            raise KeyFileError(f"line {lineno} ({name}): the key is shorter than 8 characters")
        limits = {"rpm": default_rpm, "concurrent": default_concurrent}
        for field_no, option in enumerate(options, 3):
            key, sep, value = option.partition("=")
            if not sep or key not in limits or not value.isdigit() or int(value) < 1:
                # Never echo the field: it may be (part of) a key.
                raise KeyFileError(f"line {lineno} ({name}): field {field_no} is not an "
                                   "option (rpm=N, concurrent=N; N >= 1)")
            limits[key] = int(value)
        digest = _digest(secret)
        if name in names or digest in digests:
            raise KeyFileError(f"line {lineno} ({name}): a name or key listed twice")
        names.add(name)
        digests.add(digest)
        keys.append(ApiKey(name, digest, limits["rpm"], limits["concurrent"]))
    if not keys:
        raise KeyFileError("the key file lists no keys")
    return keys


def load_key_file(path: str, *, default_rpm: int | None = None,
                  default_concurrent: int | None = None) -> list[ApiKey]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"--api-key-file {path}: {exc}") from None
    try:
        return parse_key_file(text, default_rpm=default_rpm, default_concurrent=default_concurrent)
    except KeyFileError as exc:
        raise KeyFileError(f"--api-key-file {path}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a key's request is refused (HTTP 429), and when to retry."""

    reason: str  # "rate_limited" or "concurrency_limited"
    message: str
    retry_after_s: int


class _KeyState:
    __slots__ = ("tokens", "updated", "in_flight", "admitted", "rate_limited", "concurrency_limited")

    def __init__(self, rpm: int | None, now: float) -> None:
        self.tokens = float(rpm or 0)
        self.updated = now
        self.in_flight = 0
        self.admitted = 0
        self.rate_limited = 0
        self.concurrency_limited = 0


class KeyRing:
    """The named keys and their limits' state."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys = list(keys)
        self._by_digest = {k.digest: k for k in self.keys}
        self._state: dict[str, _KeyState] = {}

    def identify(self, offered: str | bytes | None) -> ApiKey | None:
        """The key `offered` is (a lookup by its sha256, so no key is compared character by character)."""
        if not offered:
            return None
        return self._by_digest.get(_digest(offered))

    def _state_of(self, key: ApiKey) -> _KeyState:
        state = self._state.get(key.name)
        if state is None:
            state = self._state[key.name] = _KeyState(key.rpm, trio.current_time())
        return state

    def admit(self, key: ApiKey) -> Refusal | None:
        """Take one request for `key` (in flight until `release`); a Refusal when a limit says no."""
        state = self._state_of(key)
        if key.max_concurrent is not None and state.in_flight >= key.max_concurrent:
            state.concurrency_limited += 1
            return Refusal("concurrency_limited",
                           f"key {key.name!r} has {state.in_flight} requests in flight, its limit", 1)
        if key.rpm is not None:
            now = trio.current_time()
            rate = key.rpm / 60.0
            state.tokens = min(float(key.rpm), state.tokens + (now - state.updated) * rate)
            state.updated = now
            if state.tokens < 1.0:
                state.rate_limited += 1
                wait = max(1, math.ceil((1.0 - state.tokens) / rate))
                return Refusal("rate_limited", f"key {key.name!r} is over its {key.rpm} requests per minute", wait)
            state.tokens -= 1.0
        state.in_flight += 1
        state.admitted += 1
        return None

    def release(self, key: ApiKey) -> None:
        self._state_of(key).in_flight -= 1

    def statistics(self) -> dict[str, dict[str, int]]:
        """Per key name: admitted, rate_limited, concurrency_limited, in_flight (for /metrics)."""
        counts = ("admitted", "rate_limited", "concurrency_limited", "in_flight")
        return {key.name: {c: getattr(self._state[key.name], c) if key.name in self._state else 0 for c in counts}
                for key in self.keys}


def offered_key(headers: object, subprotocol_key: bytes | None = None) -> str | bytes | None:
    """The key a request offers: a websocket subprotocol, x-api-key (Anthropic's clients), or a Bearer token."""
    if subprotocol_key is not None:
        return subprotocol_key
    get = getattr(headers, "get")
    x_api_key = get("x-api-key")
    if x_api_key is not None:
        return str(x_api_key).strip()
    scheme, _, token = str(get("Authorization", "")).partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


BEARER_SUBPROTOCOL_PREFIX = "trillm.bearer."


def subprotocol_api_key(protocols: Iterable[str]) -> bytes | None:
    """The API key a client offered as the subprotocol "trillm.bearer.<key, base64url without padding>" (a
    browser cannot set a websocket's Authorization header), or None."""
    for protocol in protocols:
        if protocol.startswith(BEARER_SUBPROTOCOL_PREFIX):
            encoded = protocol[len(BEARER_SUBPROTOCOL_PREFIX):]
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            except (binascii.Error, ValueError):
                return None
    return None


class _Lease:
    """One admitted request's place in its key's in-flight count, given back exactly once."""

    __slots__ = ("ring", "key", "done")

    def __init__(self, ring: KeyRing, key: ApiKey) -> None:
        self.ring, self.key, self.done = ring, key, False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.ring.release(self.key)


class _ReleasingBody:
    """A streamed body that gives its lease back when it ends, fails, or is closed (even never iterated)."""

    def __init__(self, inner: AsyncIterator[Any], lease: _Lease) -> None:
        self._inner, self._lease = inner, lease

    def __aiter__(self) -> _ReleasingBody:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except BaseException:
            self._lease.release()
            raise

    async def aclose(self) -> None:
        self._lease.release()
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()


def install_key_limits(app: QuartTrio, ring: KeyRing, protected: Callable[[str], bool],
                       refuse: Callable[[APIError, str], Response]) -> None:
    """Per-key limits on the protected paths (after the API key check, which `install_guards` makes): 429 with
    Retry-After in the shape of the API at the path (`refuse`). A request made with --api-key or the internal
    key is not limited. A websocket counts as one request at its connection (its generations are bounded by
    --max-ws-generations)."""
    from quart import g, request, websocket
    from quart.wrappers.response import IterableBody

    from trillm.web.errors import APIError

    def refused(key: ApiKey, refusal: Refusal, path: str) -> Response:
        log.info("key %s refused on %s: %s", key.name, path, refusal.reason)
        return refuse(APIError(429, refusal.message, "rate_limit_error", refusal.reason,
                               headers={"Retry-After": str(refusal.retry_after_s)}), path)

    @app.before_request
    async def admit_key() -> Response | None:
        if not protected(request.path):
            return None
        key = ring.identify(offered_key(request.headers))
        if key is None:
            return None
        refusal = ring.admit(key)
        if refusal is not None:
            return refused(key, refusal, request.path)
        g.trillm_api_key_name = key.name  # for logs and traces: the name, never the key
        log.debug("key %s: %s %s", key.name, request.method, request.path)
        g.trillm_key_lease = _Lease(ring, key)
        return None

    @app.after_request
    async def release_key(response: Response) -> Response:
        lease: _Lease | None = g.pop("trillm_key_lease", None)
        if lease is None:
            return response
        body = response.response
        if isinstance(body, IterableBody):  # a stream: in flight until its last byte
            body.iter = _ReleasingBody(body.iter, lease)
        else:
            lease.release()
        return response

    @app.before_websocket
    async def admit_ws_key() -> Response | None:
        key = ring.identify(offered_key(websocket.headers, subprotocol_api_key(websocket.requested_subprotocols)))
        if key is None:
            return None
        refusal = ring.admit(key)
        if refusal is not None:
            return refused(key, refusal, websocket.path)
        ring.release(key)
        return None
