"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, whatever went wrong
(on Anthropic's Messages API routes, Anthropic's: `{"type": "error", "error": {"type", "message"}}`).

The official SDK reads `body["error"]` to build its exception, and FastAPI's own `{"detail": ..}`
would reach users as an unreadable message, so every error path of the app ends here.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from fastapi.responses import JSONResponse

from xlaserve.runtime.sampling.grammar import CONSTRAINT_DEAD_END

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}

# Anthropic's error types by status (its Messages API: /v1/messages...).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"  # the routes whose errors are Anthropic's shape

# The error of every request the stopping server refuses or aborts (the engine's final chunks
# carry it too, so a cut-off generation is told apart from a failed one).
SHUTDOWN_MESSAGE = "the server is shutting down"
SHUTDOWN_RETRY_AFTER_S = 5


class APIError(Exception):
    """Raised anywhere in a route: becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's shape, for the Messages API's routes."""
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"),
            "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error's response; Anthropic's shape where `path` (the request's) is one of its
        Messages API's routes."""
        anthropic = path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")
        return JSONResponse(self.anthropic_body() if anthropic else self.body(),
                            status_code=self.status, headers=self.headers)


def shutting_down() -> APIError:
    """The 503 of a request refused, or cut off, because the server is stopping (shutdown.py):
    a client or load balancer retries it elsewhere, or here once the server is back."""
    return APIError(503, SHUTDOWN_MESSAGE, headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})


def generation_error(message: str) -> APIError:
    """The error a request's final chunk carried: the engine's abort at shutdown is a 503 a client
    may retry; an output its constraint could not complete is the request's own 400 (its schema
    or grammar has a part nothing satisfies: retrying gives the same); anything else failed this
    request (a 500 naming what went wrong)."""
    if message == SHUTDOWN_MESSAGE:
        return shutting_down()
    if message.startswith(CONSTRAINT_DEAD_END):
        return APIError(400, message, code="constraint_unsatisfiable")
    return APIError(500, f"generation failed: {message}")


@contextlib.contextmanager
def renamed_errors(rename: Callable[[APIError], APIError]) -> Iterator[None]:
    """An APIError raised inside re-raised as `rename` makes it: an API run through another's
    checks (the Responses and Messages APIs through chat's) names its own fields."""
    try:
        yield
    except APIError as error:
        raise rename(error) from None


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(param: str, what: str | None = None) -> APIError:
    """A parameter we parse but do not implement: a 400 that says so, never silently ignored."""
    return APIError(400, f"{what or param} is not supported by this server", param=param,
                    code="unsupported_parameter")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A pydantic / FastAPI validation error list -> (one readable message, the offending field)."""
    parts, param = [], None
    for error in errors[:3]:
        loc = [str(x) for x in error.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path"):  # where in the request, not a name
            loc = loc[1:]
        where = ".".join(loc)[:200]  # a client's key names are echoed: bounded
        if param is None and loc:
            param = loc[0][:200]
        message = error.get("msg", "invalid value")
        if error.get("type") == "json_invalid":
            message = "the request body is not valid JSON: " + str(error.get("ctx", {}).get("error", ""))
        elif error.get("type") == "extra_forbidden":
            message = "unknown or unsupported parameter"
        elif error.get("type") == "model_attributes_type" and not loc:
            message = "the request body must be a JSON object"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts), param
