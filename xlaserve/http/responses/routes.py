"""Responses API routes: `POST /v1/responses` (JSON, SSE with `stream`, or at once with
`background`), `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`. The app's ResponseStore
(store.py) is `app.state.responses`."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from xlaserve.http.disconnect import until_disconnect
from xlaserve.http.errors import bad_request
from xlaserve.http.responses.call import ResponseCall
from xlaserve.http.responses.protocol import ResponsesRequest
from xlaserve.http.responses.store import ResponseStore, public
from xlaserve.http.responses.stream import events
from xlaserve.http.serving import LARGE_BODY_BYTES, parse_off_loop, run_off_loop

router = APIRouter()


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


@router.post("/v1/responses")
async def create_response(request: Request):
    store = store_of(request)
    body = await request.body()
    req = await parse_off_loop(body, ResponsesRequest)
    previous = await store.previous(req.previous_response_id)
    # Canonical items and the chat request: off the event loop for a large body, as its parse.
    call = await run_off_loop(len(body), LARGE_BODY_BYTES, ResponseCall,
                              request.app.state.ctx, req, previous)
    await call.create()
    if req.stream:
        return StreamingResponse(events(call, store), media_type="text/event-stream")
    if req.background:
        return await store.start_background(call)
    chat_body = await until_disconnect(request, call.chat.response(),
                                       call.chat.generation.group.abort)
    response = call.finished(chat_body)
    await store.save(call, response)
    return response


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    return public(await store_of(request).record(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    return await store_of(request).delete(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request):
    return await store_of(request).cancel(response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: int = 20, order: Literal["asc", "desc"] = "desc"):
    """The conversation the response answered (previous_response_id's included), newest first
    by default; each item has an id (items.input_items)."""
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", "limit")
    items = list((await store_of(request).record(response_id))["_input"])
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise bad_request(f"no input item {after[:64]!r} in this response", "after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
