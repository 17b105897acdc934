"""Anthropic's Messages API routes: `POST /v1/messages` (JSON, or SSE events with `stream`) and
`POST /v1/messages/count_tokens`. Their errors are Anthropic-shaped (errors.APIError.response),
and the key may come as `x-api-key` (app.RequireApiKey)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from xlaserve.http.disconnect import until_disconnect
from xlaserve.http.messages.call import MessageCall
from xlaserve.http.messages.protocol import CountTokensRequest, MessagesRequest
from xlaserve.http.messages.stream import events
from xlaserve.http.request_fields import with_ignored_fields
from xlaserve.http.serving import LARGE_BODY_BYTES, parse_off_loop, run_off_loop

router = APIRouter()


async def _call(request: Request, model) -> MessageCall:
    ctx = request.app.state.ctx
    body = await request.body()
    req = await parse_off_loop(body, model, ctx.request_fields)
    # The conversion walks every block: off the event loop for a large body, as its parse.
    return await run_off_loop(len(body), LARGE_BODY_BYTES, MessageCall, ctx, req)


@router.post("/v1/messages")
async def create_message(request: Request):
    call = await _call(request, MessagesRequest)
    await call.create()
    if call.req.stream:
        response = StreamingResponse(events(call), media_type="text/event-stream")
    else:
        chat_body = await until_disconnect(request, call.chat.response(),
                                           call.chat.generation.group.abort)
        response = JSONResponse(call.finished(chat_body))
    return with_ignored_fields(response, call.ignored)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    call = await _call(request, CountTokensRequest)
    return with_ignored_fields(JSONResponse({"input_tokens": await call.input_tokens()}),
                               call.ignored)
