"""The FastAPI app: routes, who may call them (guards.py), payload limit, request log and
metrics, and OpenAI-shaped errors everywhere.

`create_app(ctx, api_key=..., max_payload_size=...)` builds it around a ServingContext; the
launch script runs it with uvicorn. Nothing outside `xlaserve/http/` imports FastAPI.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from xlaserve.http import native, off_loop, responses, tokenize
from xlaserve.http.batches import files, routes as batches
from xlaserve.http.chat import ChatCall
from xlaserve.http.disconnect import until_disconnect
from xlaserve.http.completions import CompletionCall
from xlaserve.http.errors import APIError, validation_message
from xlaserve.http.guards import add_guards
from xlaserve.http.protocol import ChatCompletionRequest, CompletionRequest
from xlaserve.http.request_fields import with_ignored_fields
from xlaserve.http.serving import ServingContext

logger = logging.getLogger(__name__)

# Routes a load balancer or Prometheus reaches without the API key (as in SGLang).
_OPEN_ROUTES = ("/health", "/metrics")
UNMATCHED_ROUTE = "unmatched"  # the metrics label of every path no route matches


def create_app(ctx: ServingContext, *, api_key: str | None = None,
               max_payload_size: int | None = None, log_requests: bool = False,
               lifespan=None, batch_runner=None, host: str = "127.0.0.1",
               allowed_origins: Iterable[str] = ()) -> FastAPI:
    """`batch_runner` (batch_runner.BatchRunner) adds the files and batches routes; it starts
    (resuming unfinished batches) and stops with the app, inside `lifespan`. `host`: the address
    the server listens on (on a loopback one without `api_key`, only loopback Host headers are
    answered); `allowed_origins`: browser origins answered with CORS (guards.py)."""
    app = FastAPI(title="xlaserve", version="0.1.0", lifespan=_with_batches(lifespan, batch_runner))
    app.state.ctx = ctx
    app.state.batch_runner = batch_runner
    # The Responses API stores its responses with the files and batches.
    app.state.responses = responses.ResponseStore(batch_runner.storage) if batch_runner else None

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError):
        message, param = validation_message(error.errors())
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):
        message = error.detail if isinstance(error.detail, str) else str(error.detail)
        return APIError(error.status_code, message).response()

    @app.exception_handler(Exception)
    async def internal_error(_, error: Exception):
        logger.exception("internal error while serving a request")
        return APIError(500, f"internal server error ({type(error).__name__})").response()

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
        body = await off_loop.parse(await request.body(), ChatCompletionRequest, ctx.request_fields)
        return await respond(request, await ChatCall.create(ctx, body))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await off_loop.parse(await request.body(), CompletionRequest, ctx.request_fields)
        return await respond(request, await CompletionCall.create(ctx, body))

    @app.get("/metrics")
    async def metrics():
        if ctx.metrics is None:
            raise APIError(404, "metrics are off: start the server with --enable-metrics")
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    app.include_router(native.router)
    app.include_router(tokenize.router)
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
        response = await off_loop.run(call.response_entries(), off_loop.LARGE_RESPONSE_ENTRIES,
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
            return await _too_large(self.max_bytes)(scope, receive, send)
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
                return await _too_large(self.max_bytes)(scope, receive, send)
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


def _too_large(max_bytes: int) -> JSONResponse:
    return APIError(413, _too_large_message(max_bytes), code="payload_too_large").response()
