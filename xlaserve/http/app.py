"""The FastAPI app: routes, who may call them, payload limit, request log and metrics, and
OpenAI-shaped errors everywhere.

`create_app(ctx, api_key=..., max_payload_size=...)` builds it around a ServingContext; the
launch script runs it with uvicorn. Nothing outside `xlaserve/http/` imports FastAPI.

Who may call it: the checks a request passes before anything reads its body, three ASGI
middlewares, outermost first (`add_guards` adds them in that order around the app):

- `HostAndOriginCheck`, against DNS rebinding and cross-site browsers. A server on a loopback
  address without an API key answers only a loopback Host (localhost, 127.0.0.1, [::1]): a web
  page whose domain an attacker re-points at 127.0.0.1 still sends its own name as Host (Ollama's
  defence). A request with an Origin header (a browser's) is refused unless the origin is the
  server's own or one of --allowed-origins.
- CORS (Starlette's CORSMiddleware), with --allowed-origins only: the headers and the preflight
  answers a browser needs to call the server from those origins.
- `RequireApiKey`: 'Authorization: Bearer <key>' (or Anthropic's 'x-api-key: <key>') on every
  route but the open ones (/health and /metrics, as in SGLang) and OPTIONS. Outside the payload
  limit, so an unauthenticated upload gets its 401 at once instead of after up to
  --max-payload-size bytes have been read.

Refusals are OpenAI-shaped (errors.APIError): 403 "permission_error", 401 "authentication_error"
(Anthropic-shaped on the Messages API's routes).
"""
from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
from typing import Iterable
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match

from xlaserve.http import (lora_routes, messages, native, responses, rl_routes, tokenize,
                           worker_info)
from xlaserve.http.pooling import classify, embeddings, rerank
from xlaserve.http.batches import files, routes as batches
from xlaserve.http.chat import ChatCall
from xlaserve.http.disconnect import until_disconnect
from xlaserve.http.completions import CompletionCall
from xlaserve.http.errors import APIError, validation_message
from xlaserve.http.protocol import ChatCompletionRequest, CompletionRequest
from xlaserve.http.request_fields import with_ignored_fields
from xlaserve.http.serving import (LARGE_RESPONSE_ENTRIES, ServingContext, parse_off_loop,
                                   run_off_loop)

logger = logging.getLogger(__name__)

# Routes a load balancer or Prometheus reaches without the API key (as in SGLang).
_OPEN_ROUTES = ("/health", "/metrics")
UNMATCHED_ROUTE = "unmatched"  # the metrics label of every path no route matches
_DEFAULT_PORTS = {"http": 80, "https": 443}


def create_app(ctx: ServingContext, *, api_key: str | None = None,
               max_payload_size: int | None = None, log_requests: bool = False,
               lifespan=None, batch_runner=None, host: str = "127.0.0.1",
               allowed_origins: Iterable[str] = ()) -> FastAPI:
    """`batch_runner` (batch_runner.BatchRunner) adds the files and batches routes; it starts
    (resuming unfinished batches) and stops with the app, inside `lifespan`. `host`: the address
    the server listens on (on a loopback one without `api_key`, only loopback Host headers are
    answered); `allowed_origins`: browser origins answered with CORS (`add_guards`)."""
    app = FastAPI(title="xlaserve", version="0.1.0", lifespan=_with_batches(lifespan, batch_runner))
    app.state.ctx = ctx
    app.state.batch_runner = batch_runner
    # The Responses API stores its responses with the files and batches.
    app.state.responses = responses.ResponseStore(batch_runner.storage) if batch_runner else None

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        message, param = validation_message(error.errors())
        return APIError(400, message, param=param).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        message = error.detail if isinstance(error.detail, str) else str(error.detail)
        return APIError(error.status_code, message).response(request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        logger.exception("internal error while serving a request")
        return APIError(500, f"internal server error ({type(error).__name__})").response(
            request.url.path)

    # Starlette runs the middleware added last first: the recorder sees every answer, and the
    # Host, Origin and key checks answer before PayloadLimit reads a body.
    if max_payload_size:  # uploads have their own limit, --max-file-size (files.py)
        app.add_middleware(PayloadLimit, max_bytes=max_payload_size,
                           exempt=("/v1/files",) if batch_runner is not None else ())
    add_guards(app, api_key=api_key, host=host, allowed_origins=allowed_origins,
               open_paths=_OPEN_ROUTES)
    if log_requests or ctx.metrics is not None:
        app.add_middleware(RecordRequests, routes=app.router.routes, metrics=ctx.metrics,
                           log_requests=log_requests)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_off_loop(await request.body(), ChatCompletionRequest, ctx.request_fields)
        return await respond(request, await ChatCall.create(ctx, body))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_off_loop(await request.body(), CompletionRequest, ctx.request_fields)
        return await respond(request, await CompletionCall.create(ctx, body))

    @app.get("/metrics")
    async def metrics():
        if ctx.metrics is None:
            raise APIError(404, "metrics are off: start the server with --enable-metrics")
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    app.include_router(native.router)
    app.include_router(worker_info.router)
    app.include_router(tokenize.router)
    app.include_router(lora_routes.router)
    app.include_router(rl_routes.router)
    app.include_router(embeddings.router)
    app.include_router(rerank.router)
    app.include_router(classify.router)
    app.include_router(messages.router)
    if batch_runner is not None:
        app.include_router(files.router)
        app.include_router(batches.router)
        app.include_router(responses.router)
    return app


def _with_batches(lifespan, batch_runner):
    if batch_runner is None:
        return lifespan

    @contextlib.asynccontextmanager
    async def both(app):
        async with lifespan(app) if lifespan is not None else contextlib.nullcontext():
            batch_runner.start()
            try:
                yield
            finally:
                await app.state.responses.stop()  # before batch_runner closes the storage
                await batch_runner.stop()  # before the outer lifespan stops the engine

    return both


async def respond(request: Request, call: ChatCall | CompletionCall):
    """SSE for `stream: true`, else one JSON body once every choice has finished (a large one
    rendered off the event loop)."""
    if call.req.stream:
        response = StreamingResponse(call.stream(), media_type="text/event-stream")
    else:
        content = await until_disconnect(request, call.response(), call.generation.group.abort)
        response = await run_off_loop(call.response_entries(), LARGE_RESPONSE_ENTRIES,
                                      JSONResponse, content)
    return with_ignored_fields(response, call.req.ignored_fields)


class RecordRequests:
    """Logs each request (--log-requests) and counts it in /metrics by route and status. The
    route is the matched route's template (`/v1/files/{file_id}`), never the raw path, so a
    client cannot add series without end; a path no route matches counts as "unmatched"."""

    def __init__(self, app, routes: list, metrics, log_requests: bool):
        self.app = app
        self.routes = routes  # the app's, matched here for answers given before routing (401)
        self.metrics = metrics
        self.log_requests = log_requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self._record(scope, status)
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except Exception:
            if status is None:  # the app's 500 handler answers outside this middleware
                self._record(scope, 500)
            raise

    def _record(self, scope, status: int) -> None:
        if self.log_requests:
            logger.info("%s %s -> %d", scope["method"], scope["path"], status)
        if self.metrics is not None:
            self.metrics.http_request(self._route(scope), status)

    def _route(self, scope) -> str:
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] is not Match.NONE), None)
        return getattr(route, "path", UNMATCHED_ROUTE)


class PayloadLimit:
    """Refuses bodies over `max_bytes` with a 413, whether announced (Content-Length) or streamed:
    the body is read here first (the routes read all of it anyway) and replayed to the app."""

    def __init__(self, app, max_bytes: int, exempt: tuple[str, ...] = ()):
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _too_large(self.max_bytes, scope["path"])(scope, receive, send)
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await _too_large(self.max_bytes, scope["path"])(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()  # after the body: disconnect notices

        await self.app(scope, replay, send)


def _too_large_message(max_bytes: int) -> str:
    return f"Payload Too Large: the request body is over --max-payload-size ({max_bytes} bytes)"


def _too_large(max_bytes: int, path: str) -> JSONResponse:
    return APIError(413, _too_large_message(max_bytes), code="payload_too_large").response(path)


# --- who may call (module docstring) --------------------------------------------------------

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
    """The key as OpenAI's clients send it ('Authorization: Bearer <key>') or Anthropic's
    ('x-api-key: <key>')."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()
        self.open_paths = open_paths

    def _authorized(self, scope) -> bool:
        return (hmac.compare_digest(_header(scope, b"authorization"), self.expected)
                or hmac.compare_digest(_header(scope, b"x-api-key"), self.expected_key))

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"] not in self.open_paths and not self._authorized(scope)):
            refusal = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                               "<key>' (or Anthropic's 'x-api-key: <key>')", code="invalid_api_key")
            return await refusal.response(scope["path"])(scope, receive, send)
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
                return await refusal.response(scope["path"])(scope, receive, send)
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
