"""A non-streamed generation that stops when its client goes away (the chat, completions and
Responses routes)."""
from __future__ import annotations

import asyncio

from fastapi import Request

from xlaserve.http.errors import APIError

_DISCONNECT_POLL_S = 0.5


async def until_disconnect(request: Request, work, abort):
    """Runs a non-streamed generation; if the client goes away first, `abort` frees its slots at
    once (the work may not have started, so cancelling it alone would not)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
            abort()
