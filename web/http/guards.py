"""The checks every trillm front makes (a server and the router alike): the API key, a browser's Origin, and
errors in the shape of the API at their path."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from quart import Response, current_app, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trillm.web.errors import APIError
from trillm.web.http.body import json_response
from trillm.web.http.keys import KeyRing, offered_key, subprotocol_api_key


ErrorShape = Callable[[APIError], tuple[int, dict[str, Any]]]  # an API's status and body for an error
_ERROR_SHAPES = "trillm.error_shapes"


def register_error_shape(app: QuartTrio, prefix: str, shape: ErrorShape) -> None:
    """Errors on `prefix` and the paths below it take `shape` (an API surface's own); OpenAI's elsewhere."""
    app.extensions.setdefault(_ERROR_SHAPES, {})[prefix] = shape


def error_response(err: APIError, path: str = "") -> Response:
    """The error in the shape of the API at `path` (see `register_error_shape`)."""
    shapes: dict[str, ErrorShape] = current_app.extensions.get(_ERROR_SHAPES, {}) if path else {}
    for prefix, shape in shapes.items():
        if path == prefix or path.startswith(prefix + "/"):
            status, body = shape(err)
            return json_response(body, status, err.headers)
    return json_response(err.body(), err.status, err.headers)


ORIGIN_REFUSED = APIError(403, "cross-origin request refused: this page's origin may not use this server (see "
                                "--allowed-origin)", "permission_error", "origin_not_allowed")
WRONG_KEY = APIError(401, "missing or wrong API key (Authorization: Bearer ... or x-api-key)", "authentication_error",
                     "invalid_api_key")


def is_authorized(api_key: str | None, headers: Any, offered_key: bytes | None = None) -> bool:
    """No key configured, or the right one: a Bearer token, x-api-key, or offered as a websocket subprotocol."""
    if api_key is None:
        return True
    if offered_key is not None and hmac.compare_digest(offered_key, api_key.encode()):
        return True
    x_api_key = headers.get("x-api-key")  # Anthropic's clients send the key here
    if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), api_key.encode()):
        return True
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def is_protected(path: str) -> bool:
    """What needs the API key: the API, internal feeds and the tokenizer endpoints (not /, /health, /metrics)."""
    return path.startswith(("/v1/", "/internal/")) or path in ("/tokenize", "/detokenize", "/tokenizer_info")


def is_loopback_host(host: str) -> bool:
    """localhost, *.localhost (browsers resolve both to loopback, never through DNS) or a loopback address."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    address = _ip_literal(host)
    return address is not None and address.is_loopback


def _ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _default_port(scheme: str) -> int:
    return 443 if scheme in ("https", "wss") else 80


def same_or_allowed_origin(headers: Any, allowed_origins: Sequence[str], bind_host: str = "127.0.0.1") -> bool:
    """A web page on any site can open a websocket to 127.0.0.1 (browsers send no CORS preflight for them),
    so a browser's Origin must be one of this server's own pages, or one the operator allowed.

    The Host header cannot say which pages are this server's own: under DNS rebinding an attacker's name
    (evil.test) resolves to this server, and the browser sends `Host: evil.test:8000` with
    `Origin: http://evil.test:8000`. So an Origin is this server's own only when its host is one no DNS answer
    can make up: a loopback name or address while the server listens on loopback (a wildcard bind does too),
    or an IP address the server listens on. Its port must be the port the request came to. Anything else
    needs --allowed-origin."""
    origin: str | None = headers.get("Origin")
    if origin is None:
        return True  # not a browser
    if origin.rstrip("/") in allowed_origins or origin in allowed_origins:
        return True
    try:
        page = urlsplit(origin)
        here = urlsplit("//" + headers.get("Host", ""))
        page_port = page.port or _default_port(page.scheme)
        here_port = here.port or _default_port(page.scheme)
    except ValueError:  # a malformed port
        return False
    if page.scheme not in ("http", "https") or not page.hostname or page_port != here_port:
        return False
    address, bound = _ip_literal(page.hostname), _ip_literal(bind_host)
    wildcard = bound is not None and bound.is_unspecified  # 0.0.0.0 or ::, loopback included
    if (is_loopback_host(bind_host) or wildcard) and is_loopback_host(page.hostname):
        return True
    if address is None or bound is None:
        return False
    # The page came from one of our addresses: the one bound, or (a wildcard bind) the one this request came to.
    return address == bound or (wildcard and page.hostname.lower() == (here.hostname or "").lower())


def install_guards(app: QuartTrio, api_key: str | None, allowed_origins: Sequence[str],
                   bind_host: str = "127.0.0.1", internal_api_key: str | None = None,
                   key_ring: KeyRing | None = None) -> None:
    """The checks every trillm front makes (a server and the router alike): the API key on protected paths,
    a browser's Origin on the websockets and /internal/*, and HTTP errors in the shape of the API at that path.
    `bind_host`: the address the server listens on (what an Origin is judged against). `internal_api_key`:
    when set, the only key /internal/* takes (the rest of the API takes it too). `key_ring`: the named keys of
    --api-key-file, taken beside `api_key`."""

    def authorized(path: str, headers: Any, offered: bytes | None = None) -> bool:
        if internal_api_key is not None and is_authorized(internal_api_key, headers, offered):
            return True
        if internal_api_key is not None and path.startswith("/internal/"):
            return False
        if not is_protected(path):
            return True
        if key_ring is not None:  # then a key is needed even without --api-key
            return (key_ring.identify(offered_key(headers, offered)) is not None
                    or (api_key is not None and is_authorized(api_key, headers, offered)))
        return is_authorized(api_key, headers, offered)

    @app.before_request
    async def check_auth() -> Response | None:
        if request.path.startswith("/internal/") and not same_or_allowed_origin(
                request.headers, allowed_origins, bind_host):
            return error_response(ORIGIN_REFUSED)
        if not authorized(request.path, request.headers):
            return error_response(WRONG_KEY, request.path)
        return None

    @app.before_websocket
    async def check_ws_auth() -> Response | None:
        if not same_or_allowed_origin(websocket.headers, allowed_origins, bind_host):
            return error_response(ORIGIN_REFUSED)
        if not authorized(websocket.path, websocket.headers, subprotocol_api_key(websocket.requested_subprotocols)):
            return error_response(WRONG_KEY)
        return None

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        return error_response(APIError(code, exc.description or exc.name,
                                       "invalid_request_error" if code < 500 else "server_error", exc.name),
                              request.path)
