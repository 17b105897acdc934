"""An RL trainer's routes, SGLang's names and bodies: `/update_weights_from_disk`,
`/update_weights_from_tensor`, `/get_weights_by_name`, `/release_memory_occupation`,
`/resume_memory_occupation`, `/pause_generation`, `/continue_generation`, `/get_weight_version`,
`/update_weight_version`; vLLM's `/sleep`, `/wake_up` and `/is_sleeping` over the same calls.
The engine side is runtime/engine/weight_updates.py; each call waits for it off the event loop.

Refused by name: `/init_weights_update_group` and `/update_weights_from_distributed` (SGLang's
NCCL groups: no transport is built for them here), SGLang's pickled tensors (they run code
when read: send safetensors files), a `manifest`."""
from __future__ import annotations

import asyncio
import base64
import binascii

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from xlaserve.http.errors import bad_request
from xlaserve.http.protocol import (ContinueGenerationRequest, GetWeightsByNameRequest,
                                    MemoryTagsRequest, PauseGenerationRequest,
                                    UpdateWeightsFromDiskRequest, UpdateWeightsFromTensorRequest,
                                    UpdateWeightVersionRequest, WeightUpdateOptions)
from xlaserve.http.request_fields import parse_body
from xlaserve.http.serving import ServingContext
from xlaserve.runtime.engine import WeightUpdateError
from xlaserve.weights import WeightError, safetensors_tensors

router = APIRouter()
_DISTRIBUTED = ("weight updates over a process group (SGLang's NCCL group) are not built: "
                "update from disk (/update_weights_from_disk), from safetensors bytes "
                "(/update_weights_from_tensor), or in process (Engine.update_weights)")


def _weights(request: Request):
    """The engine's WeightUpdates; a 400 where there is none (--dp-size > 1)."""
    ctx: ServingContext = request.app.state.ctx
    weights = getattr(ctx.core, "weights", None)
    if weights is None:
        raise bad_request("the RL routes are not built with --dp-size > 1")
    return weights


async def _body(request: Request, model):
    """The body as `model`; an empty one is `{}` (SGLang's clients post some without)."""
    raw = await request.body()
    return parse_body(raw or b"{}", model, request.app.state.ctx.request_fields)


async def _call(function, *args, **kwargs):
    """`function` off the event loop; a WeightUpdateError is a 400."""
    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    except WeightUpdateError as error:
        raise bad_request(str(error)) from None


def _options(req: WeightUpdateOptions) -> dict:
    return dict(flush_cache=req.flush_cache, abort_all_requests=req.abort_all_requests,
                weight_version=req.weight_version)


def _answer(success: bool, message: str, **fields) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **fields},
                        status_code=200 if success else 400)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    req = await _body(request, UpdateWeightsFromDiskRequest)
    weights = _weights(request)
    if req.manifest is not None:
        return _answer(False, "manifest: reading a checkpoint by a manifest is not built",
                       num_paused_requests=0)
    try:
        paused = await asyncio.to_thread(
            weights.update_from_disk, req.model_path, req.load_format, is_async=req.is_async,
            keep_pause=req.keep_pause, **_options(req))
    except WeightUpdateError as error:
        return _answer(False, str(error), num_paused_requests=0)
    return _answer(True, "Succeeded to update model weights.", num_paused_requests=paused)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request):
    req = await _body(request, UpdateWeightsFromTensorRequest)
    weights = _weights(request)
    if req.load_format not in (None, "direct", "safetensors"):
        return _answer(False, f"load_format {req.load_format!r}: each entry is a safetensors "
                              "file's bytes, base64")
    try:
        tensors = await asyncio.to_thread(_decoded, req.serialized_named_tensors)
        awaited = await asyncio.to_thread(weights.update_named, tensors, **_options(req))
    except (WeightUpdateError, WeightError) as error:
        return _answer(False, str(error))
    return _answer(True, awaited or "Succeeded to update model weights.")


def _decoded(entries: list[str]) -> dict:
    """{name: array} of every entry's safetensors file; a name given twice is refused."""
    tensors: dict = {}
    for i, entry in enumerate(entries):
        try:
            data = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError):
            raise WeightError(f"serialized_named_tensors[{i}] is not base64") from None
        for name, array in safetensors_tensors(data).items():
            if name in tensors:
                raise WeightError(f"serialized_named_tensors: {name!r} is given twice")
            tensors[name] = array
    return tensors


@router.post("/init_weights_update_group")
@router.post("/update_weights_from_distributed")
@router.post("/destroy_weights_update_group")
async def weights_update_group(request: Request):
    return _answer(False, _DISTRIBUTED)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request):
    req = await _body(request, GetWeightsByNameRequest)
    return await _call(_weights(request).weight, req.name, req.truncate_size)


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request):
    req = await _body(request, MemoryTagsRequest)
    await _call(_weights(request).release, req.tags)
    return {"success": True, "message": "Memory released."}


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request):
    req = await _body(request, MemoryTagsRequest)
    await _call(_weights(request).resume, req.tags)
    return {"success": True, "message": "Memory resumed."}


@router.post("/pause_generation")
async def pause_generation(request: Request):
    req = await _body(request, PauseGenerationRequest)
    await _call(_weights(request).pause, req.mode)
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request):
    await _body(request, ContinueGenerationRequest)
    await _call(_weights(request).resume_generation)
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return {"weight_version": _weights(request).version}


@router.post("/update_weight_version")
async def update_weight_version(request: Request):
    req = await _body(request, UpdateWeightVersionRequest)
    await _call(_weights(request).set_version, req.new_version, req.abort_all_requests)
    return {"success": True, "message": "Weight version updated.", "new_version": req.new_version}


# --- vLLM's sleep mode over the same calls ------------------------------------------------------

@router.post("/sleep")
async def sleep(request: Request, level: int = 1):
    """Level 1: the weights kept on the host, the KV cache dropped; level 2: both dropped (an
    update must follow the wake-up)."""
    if level not in (1, 2):
        raise bad_request(f"level {level}: 1 or 2", "level")
    await _call(_weights(request).release, None, backup=level == 1)
    return JSONResponse({}, status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request):
    tags = request.query_params.getlist("tags") or None
    if tags and any(t not in ("weights", "kv_cache") for t in tags):
        raise bad_request(f"tags {tags}: weights and kv_cache", "tags")
    await _call(_weights(request).resume, tags)
    return JSONResponse({}, status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": _weights(request).sleeping()}
