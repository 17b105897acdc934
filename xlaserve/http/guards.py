"""Who may call the server: the checks a request passes before anything reads its body.

Three ASGI middlewares, outermost first (`add_guards` adds them in that order around the app):

- `HostAndOriginCheck`, against DNS rebinding and cross-site browsers. A server on a loopback
  address without an API key answers only a loopback Host (localhost, 127.0.0.1, [::1]): a web
  page whose domain an attacker re-points at 127.0.0.1 still sends its own name as Host (Ollama's
  defence). A request with an Origin header (a browser's) is refused unless the origin is the
  server's own or one of --allowed-origins.
- CORS (Starlette's CORSMiddleware), with --allowed-origins only: the headers and the preflight
  answers a browser needs to call the server from those origins.
- `RequireApiKey`: 'Authorization: Bearer <key>' on every route but the open ones (/health and
  /metrics, as in SGLang) and OPTIONS. Outside the payload limit, so an unauthenticated upload
  gets its 401 at once instead of after up to --max-payload-size bytes have been read.

Refusals are OpenAI-shaped (errors.APIError): 403 "permission_error", 401 "authentication_error".
"""
from __future__ import annotations

import hmac
import ipaddress
from typing import Iterable
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware

from xlaserve.http.errors import APIError

_DEFAULT_PORTS = {"http": 80, "https": 443}


def add_guards(app, *, api_key: str | None, host: str, allowed_origins: Iterable[str],
               open_paths: tuple[str, ...]) -> None:
    """Adds the three around what `app` has so far (Starlette runs the one added last first).
    `host`: the address the server listens on."""
    origins = _normalized(allowed_origins)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key, open_paths=open_paths)
    if origins:
        # Bearer keys, not cookies: no credentials, and any method and header the routes take.
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(HostAndOriginCheck, loopback_host_only=_is_loopback(host) and not api_key,
                       allowed_origins=origins)


class RequireApiKey:
    def __init__(self, app, api_key: str, open_paths: tuple[str, ...]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"] not in self.open_paths
                and not hmac.compare_digest(_header(scope, b"authorization"), self.expected)):
            refusal = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
            return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)


class HostAndOriginCheck:
    def __init__(self, app, loopback_host_only: bool, allowed_origins: frozenset[str]):
        self.app = app
        self.loopback_host_only = loopback_host_only
        self.allowed_origins = allowed_origins

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        host = _header(scope, b"host").decode("latin-1")
        # No Host at all (HTTP/1.0) cannot come from a browser, so it is no rebinding attempt.
        if self.loopback_host_only and host and not _is_loopback(_hostname(host)):
            return APIError(
                403, f"Host {host!r} is refused: a server on a loopback address without --api-key "
                     "answers only localhost, 127.0.0.1 and [::1] (DNS rebinding protection)",
                code="host_not_allowed")
        origin = _header(scope, b"origin").decode("latin-1")
        if (origin and "*" not in self.allowed_origins
                and origin.lower().rstrip("/") not in self.allowed_origins
                and not _is_own_origin(origin, scope["scheme"], host)):
            return APIError(403, f"Origin {origin!r} is not allowed: add it to --allowed-origins",
                            code="origin_not_allowed")
        return None


def _header(scope, name: bytes) -> bytes:
    return next((value for key, value in scope["headers"] if key == name), b"")


def _normalized(origins: Iterable[str]) -> frozenset[str]:
    """'http://A.example:3000/ , *' -> {'http://a.example:3000', '*'}: as browsers send them."""
    return frozenset(o.strip().lower().rstrip("/") for o in origins if o and o.strip())


def _hostname(host: str) -> str:
    """A Host header's name: '[::1]:8000' -> '::1', 'LocalHost:80' -> 'localhost'."""
    try:
        return (urlsplit("//" + host).hostname or "").rstrip(".")
    except ValueError:  # an unbalanced '[': no name at all
        return ""


def _is_loopback(name: str) -> bool:
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost may resolve anywhere
        return False


def _origin_parts(scheme: str, netloc: str) -> tuple[str, str, int | None] | None:
    """(scheme, name, port), the default port filled in; None for a bad port or bracket."""
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    return parts.scheme, (parts.hostname or "").rstrip("."), port


def _is_own_origin(origin: str, scheme: str, host: str) -> bool:
    """Whether `origin` is the server's own: the scheme, name and port the request came to."""
    origin_scheme, separator, netloc = origin.partition("://")
    own = _origin_parts(scheme, host) if separator and host else None
    return own is not None and _origin_parts(origin_scheme, netloc) == own
