"""Loading and unloading LoRA adapters while serving (issue 53): SGLang's `/load_lora_adapter`
and `/unload_lora_adapter`, vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, with
`lora_name` and `lora_path`. A load reads the adapter's files off the event loop and is served
once its slot is written between two steps (no compile); an unload refuses new requests for the
name at once and answers once its running requests have ended
(runtime/engine/lora_adapters.py)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from xlaserve.http.errors import APIError, bad_request
from xlaserve.http.protocol import LoadLoraRequest, UnloadLoraRequest
from xlaserve.http.request_fields import parse_body
from xlaserve.http.serving import ServingContext
from xlaserve.server_args import check_adapter_name
from xlaserve.runtime.engine.lora_adapters import NO_ADAPTERS, UnknownAdapter
from xlaserve.weights.lora_adapter import LoraAdapterError

router = APIRouter()


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


async def _body(request: Request, model):
    """(the context, the parsed body); a 400 where the server serves no adapters."""
    ctx = _ctx(request)
    req = parse_body(await request.body(), model, ctx.request_fields)
    if ctx.core.features.lora is None:
        raise bad_request(NO_ADAPTERS)
    return ctx, req


async def _load(request: Request) -> str:
    ctx, req = await _body(request, LoadLoraRequest)
    try:
        check_adapter_name(req.lora_name)
    except ValueError as error:
        raise bad_request(str(error), "lora_name") from None
    if ctx.serves(req.lora_name):
        raise bad_request(f"{req.lora_name!r} is the served model's name", "lora_name")
    try:
        await asyncio.to_thread(ctx.core.load_lora_adapter, req.lora_name, req.lora_path)
    except LoraAdapterError as error:
        raise bad_request(str(error), "lora_path") from None
    return req.lora_name


async def _unload(request: Request) -> str:
    ctx, req = await _body(request, UnloadLoraRequest)
    try:
        await asyncio.to_thread(ctx.core.unload_lora_adapter, req.lora_name)
    except UnknownAdapter as error:
        raise APIError(404, str(error), param="lora_name", code="lora_not_found") from None
    return req.lora_name


def _loaded(ctx: ServingContext) -> dict:
    return {a.name: a.path for a in ctx.core.features.lora.cards()}


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request):
    """SGLang's answer: success, error_message, loaded_adapters."""
    await _load(request)
    return {"success": True, "error_message": "", "loaded_adapters": _loaded(_ctx(request))}


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    await _unload(request)
    return {"success": True, "error_message": "", "loaded_adapters": _loaded(_ctx(request))}


@router.post("/v1/load_lora_adapter")
async def v1_load_lora_adapter(request: Request):
    """vLLM's answer: a line of text."""
    name = await _load(request)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def v1_unload_lora_adapter(request: Request):
    name = await _unload(request)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
