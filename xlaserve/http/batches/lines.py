"""The lines of a batch: reading the input JSONL, running one line through the live endpoint's
code, the output lines, and reading back what a batch already wrote (to resume it).

Input line:  {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/chat/completions"
              | "/v1/completions" | "/v1/embeddings" (an embedding server's) ..., "body": {...the
              endpoint's request...}}
Output line: {"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id",
              "body"}, "error"}; a failed line has the error status, OpenAI's error object as
              `body`, and `error` {"code", "message"}.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from typing import Any

import orjson

from xlaserve.http.chat import ChatCall
from xlaserve.http.completions import CompletionCall
from xlaserve.http.pooling import EmbeddingCall, EmbeddingRequest
from xlaserve.http.errors import APIError, bad_request
from xlaserve.http.protocol import ChatCompletionRequest, CompletionRequest
from xlaserve.http.request_fields import validate_body
from xlaserve.http.serving import RETRY_AFTER_S, ServingContext
from xlaserve.runtime.engine.async_requests import EngineDeadError

logger = logging.getLogger(__name__)

# endpoint -> (request model, call); the same classes as the live routes.
ENDPOINTS = {"/v1/chat/completions": (ChatCompletionRequest, ChatCall),
             "/v1/completions": (CompletionRequest, CompletionCall),
             "/v1/embeddings": (EmbeddingRequest, EmbeddingCall)}  # an embedding server's
# Below every interactive request (priority 0 unless a client raises it): a batch line is
# admitted only when no interactive request waits.
BATCH_PRIORITY = -1024
MAX_REPORTED_ERRORS = 100


def endpoint_of(url: str) -> str | None:
    """`/v1/chat/completions` or SGLang's `/chat/completions` -> the endpoint, else None."""
    path = url if url.startswith("/v1/") else "/v1" + url
    return path if path in ENDPOINTS else None


@dataclasses.dataclass
class Line:
    number: int  # 1-based, in the input file
    custom_id: str
    body: Any


def _error(line: int, code: str, message: str, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def read_input(data: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[dict]]:
    """The requests of an input file, or the errors (OpenAI's `errors.data`) that fail the
    batch: a line that is not UTF-8, not a JSON object, misses a field, names another URL, or
    repeats a custom_id; an empty file; more than `max_lines` requests. Blank lines are skipped."""
    raw = [(i + 1, line) for i, line in enumerate(data.split(b"\n")) if line.strip()]
    if not raw:
        return [], [_error(None, "empty_file", "the input file has no requests")]
    if len(raw) > max_lines:
        return [], [_error(None, "too_many_requests",
                           f"the input file has {len(raw)} requests, more than --batch-max-lines "
                           f"({max_lines})")]
    lines, errors, seen = [], [], {}
    for number, text in raw:
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
        try:
            item = orjson.loads(text.decode("utf-8"))
        except UnicodeDecodeError as error:
            errors.append(_error(number, "invalid_encoding",
                                 f"line {number} is not UTF-8 (byte {error.start + 1})"))
            continue
        except orjson.JSONDecodeError as error:
            errors.append(_error(number, "invalid_json_line", f"line {number} is not valid JSON: {error}"))
            continue
        problem = _check_line(item, endpoint)
        if problem is not None:
            errors.append(_error(number, "invalid_request", f"line {number}: {problem[1]}", problem[0]))
            continue
        custom_id = item["custom_id"]
        if custom_id in seen:
            errors.append(_error(number, "duplicate_custom_id",
                                 f"line {number}: custom_id {custom_id!r} is also on line "
                                 f"{seen[custom_id]}; each request needs its own", "custom_id"))
            continue
        seen[custom_id] = number
        lines.append(Line(number, custom_id, item["body"]))
    return lines, errors


def _check_line(item: Any, endpoint: str) -> tuple[str | None, str] | None:
    """(param, what is wrong) with one input line, or None."""
    if not isinstance(item, dict):
        return None, "a request line must be a JSON object"
    for name in ("custom_id", "method", "url", "body"):
        if name not in item:
            return name, f"missing {name!r}"
    if not isinstance(item["custom_id"], str) or not item["custom_id"]:
        return "custom_id", "custom_id must be a non-empty string"
    if item["method"] != "POST":
        return "method", f"method must be POST, got {item['method']!r}"
    url = item["url"]
    if not isinstance(url, str) or endpoint_of(url) != endpoint:
        return "url", f"url {url!r} is not the batch's endpoint {endpoint}"
    if not isinstance(item["body"], dict):
        return "body", "body must be a JSON object"
    return None


async def _create_when_queued(call_class, ctx: ServingContext, req):
    """`call_class.create` below interactive requests; while the server's queue is full
    (--max-queued-requests: a 503 a live client retries) the line waits and tries again, rather
    than failing or halting its batch."""
    while True:
        try:
            return await call_class.create(ctx, req, priority=BATCH_PRIORITY)
        except APIError as error:
            if error.code != "queue_full":
                raise
            await asyncio.sleep(RETRY_AFTER_S)


async def run_line(ctx: ServingContext, endpoint: str, line: Line) -> tuple[bool, dict]:
    """Runs one request exactly as the live endpoint would (same validation, same response
    body), below interactive requests; -> (succeeded, output line). Cancelling it aborts its
    generation at once. Raises EngineDeadError when the engine cannot run anything."""
    request_model, call_class = ENDPOINTS[endpoint]
    call = None
    request_id = uuid.uuid4().hex
    try:
        req = validate_body(line.body, request_model, ctx.request_fields)
        if getattr(req, "stream", False):  # an embeddings request has no stream
            raise bad_request("stream is not supported in a batch request", "stream")
        call = await _create_when_queued(call_class, ctx, req)
        request_id = call.generation.id
        status, body = 200, await call.response()
    except asyncio.CancelledError:
        if call is not None:  # submitted but perhaps not yet read: abort it explicitly
            call.generation.group.abort()
        raise
    except APIError as error:
        if error.status == 503:  # the engine loop is not running: no line can run now
            raise EngineDeadError(error.message) from None
        status, body = error.status, error.body()
    except Exception as error:  # a bug in one line must not stop the batch
        logger.exception("batch line %r failed", line.custom_id)
        status, body = 500, APIError(500, f"internal server error ({type(error).__name__})").body()
    error = None
    if status != 200:
        detail = body["error"]
        error = {"code": detail["code"] or detail["type"], "message": detail["message"]}
    return status == 200, {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                           "response": {"status_code": status, "request_id": request_id, "body": body},
                           "error": error}


def read_results(path: str) -> list[dict]:
    """The output lines a batch wrote to `path`. A line cut off by a crash (no newline at the
    end, or not JSON) is cut from the file too, so appending goes on from a clean end."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    results, end = [], 0
    for line in data.split(b"\n")[:-1]:
        try:
            results.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            break
        end += len(line) + 1
    if end != len(data):
        logger.warning("cutting %d bytes of an unfinished line off %s", len(data) - end, path)
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return results


def encode(result: dict) -> bytes:
    return orjson.dumps(result) + b"\n"
