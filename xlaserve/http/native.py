"""SGLang's native routes: /generate, /health, /health_generate, /flush_cache; and the OpenAI
model list. What a router reads (/server_info, /model_info, the loads): worker_info.py."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response, StreamingResponse

from xlaserve.http.constraints import CONSTRAINTS, compile_constraints
from xlaserve.http.errors import APIError, bad_request, generation_error, shutting_down
from xlaserve.http.images import load_images
from xlaserve.http.prompt_bound import check_not_too_long
from xlaserve.http.protocol import GenerateRequest
from xlaserve.http.request_fields import sglang_sampling_keys, with_ignored_fields
from xlaserve.http.serving import (LARGE_PROMPT_CHARS, LARGE_RESPONSE_ENTRIES, SSE_DONE,
                                   Generation, ServingContext, check_n, check_prompt_ids,
                                   check_prompt_logprob_entries, check_request, check_top_logprobs,
                                   parse_off_loop, run_off_loop, sse, sse_error)
from xlaserve.offline import to_sampling_params
from xlaserve.runtime.engine.async_requests import EngineDeadError, sglang_output
from xlaserve.runtime.engine.image_prompts import images_per_prompt
from xlaserve.runtime.sampling.params import InvalidSamplingParam, SamplingParams
from xlaserve.server_args import public_name

router = APIRouter()


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


async def _generation(ctx: ServingContext, req: GenerateRequest) -> tuple[Generation, bool]:
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    if req.text is not None:
        if ctx.tokenizer is None:
            raise bad_request("text needs the tokenizer (--skip-tokenizer-init is set)", "text")
        batched = isinstance(req.text, list)
        texts = req.text if batched else [req.text]
        prompts = await run_off_loop(sum(map(len, texts)), LARGE_PROMPT_CHARS, _tokenize,
                                     ctx, texts)
    else:
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        prompts = req.input_ids if batched else [req.input_ids]
    if req.logprob_start_len not in (-1, 0):
        raise APIError(400, "logprob_start_len takes 0 (logprobs of every prompt token too) or -1 "
                            "(the output only)", param="logprob_start_len", code="unsupported_parameter")
    raw = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * len(prompts)
    if len(raw) != len(prompts):
        raise bad_request(f"{len(raw)} sampling_params for {len(prompts)} prompts", "sampling_params")
    prompt_param = "text" if req.text is not None else "input_ids"
    if not prompts:
        raise bad_request("no prompt given", prompt_param)
    prompt_images = None
    if req.image_data is not None:
        prompts, prompt_images = await _with_images(ctx, prompts, req.image_data, batched)
    for ids in prompts:
        check_prompt_ids(ctx, ids, prompt_param)
    lora = ctx.adapters_of(None, req.lora_path, len(prompts))
    try:  # SGLang's fields, as SamplingParams
        parsed = [to_sampling_params(sglang_sampling_keys(p, ctx.tokenizer)) for p in raw]
    except InvalidSamplingParam as error:
        raise bad_request(str(error), f"sampling_params.{error.param}") from None
    except (TypeError, ValueError) as error:
        raise bad_request(str(error), "sampling_params") from None
    for ids, (p, _) in zip(prompts, parsed, strict=True):  # typed, in range, and each fits
        check_request(ctx, len(ids), p, prompt_param, "sampling_params.max_new_tokens",
                      prefix="sampling_params.")
    ns = {n for _, n in parsed}
    if len(ns) != 1:
        raise bad_request("every prompt of one call must ask for the same n", "sampling_params")
    n = ns.pop()
    check_n(ctx, n, "sampling_params.n")
    wants_prompt_logprobs = (req.return_logprob or req.top_logprobs_num > 0) \
        and req.logprob_start_len == 0
    if wants_prompt_logprobs:
        check_prompt_logprob_entries(ctx, prompts, n, req.top_logprobs_num, "logprob_start_len")
    params: list[SamplingParams] = [p for p, _ in parsed]
    for p in params:
        for name in CONSTRAINTS:
            if getattr(p, name) is not None and not isinstance(getattr(p, name), str):
                raise bad_request(f"sampling_params.{name} must be a string"
                                  + (" (the schema as JSON text)" if name == "json_schema" else ""),
                                  f"sampling_params.{name}")
    if req.return_hidden_states:
        _check_hidden_states(ctx, prompts, params, n, req.stream)
    await compile_constraints(ctx.core, params, prefix="sampling_params.")
    rid = req.rid if isinstance(req.rid, str) else None
    generation = Generation(ctx, prompts, params, n, top_logprobs_num=req.top_logprobs_num,
                            return_logprob=req.return_logprob, rid=rid,
                            return_prompt_logprob=wants_prompt_logprobs,
                            param_prefix="sampling_params.", lora_path=lora,
                            prompt_images=prompt_images,
                            return_hidden_states=req.return_hidden_states)
    return generation, batched or n > 1


def _check_hidden_states(ctx: ServingContext, prompts: list[list[int]],
                         params: list[SamplingParams], n: int, stream: bool) -> None:
    """A 400 before anything is submitted where the server does not return hidden states (SGLang's
    words) or the response would carry more of them than --max-hidden-state-values: a row per
    token but each sequence's last; a stream (one sequence, an event per token) holds all the
    rows so far in each event."""
    rows = sum((len(ids) + max(p.max_new_tokens, 1) - 1) * n for ids, p in zip(prompts, params))
    if stream:  # event k (from 1) holds prompt + k - 1 rows
        tokens = max(params[0].max_new_tokens, 1)
        rows = tokens * len(prompts[0]) + tokens * (tokens - 1) // 2
    try:
        ctx.core.features.hidden_states.check_rows(rows)
    except ValueError as error:
        raise bad_request(str(error), "return_hidden_states") from None


async def _with_images(ctx: ServingContext, prompts: list[list[int]], image_data,
                       batched: bool) -> tuple[list[list[int]], list]:
    """SGLang's `image_data` read and each prompt's placeholders expanded (its prompt holds one
    <|image_pad|> per image, as the chat template writes them): (the prompts, a PromptImages
    or None each). URLs, data: URLs or bare base64 (SGLang takes it so)."""
    if ctx.images is None:
        raise bad_request("image_data is not supported: this server's model takes text only",
                          "image_data", code="unsupported_parameter")
    try:
        per_prompt = images_per_prompt(image_data, len(prompts), batched)
    except ValueError as error:
        raise bad_request(str(error), "image_data") from None
    expanded, prompt_images = [], []
    for i, (ids, images) in enumerate(zip(prompts, per_prompt)):
        prefix = f"image_data[{i}]" if batched else "image_data"
        parts = [(f"{prefix}[{j}]" if len(images) > 1 or batched else prefix,
                  url if not isinstance(url, str) or ":" in url[:16]
                  else "data:image/*;base64," + url) for j, url in enumerate(images)]
        if any(not isinstance(url, str) for _, url in parts):
            raise bad_request("an image is a URL, a data: URL or base64 text", prefix)
        read = await load_images(ctx.core.args, parts, ctx.images.max_images) if parts else []
        try:
            ids, prompt = await asyncio.to_thread(ctx.images.prepare, ids, read)
        except ValueError as error:
            raise bad_request(str(error), prefix) from None
        expanded.append(ids)
        prompt_images.append(prompt)
    return expanded, prompt_images


@router.post("/generate")
async def generate(request: Request):
    ctx = _ctx(request)
    req = await parse_off_loop(await request.body(), GenerateRequest, ctx.request_fields)
    check_top_logprobs(req.top_logprobs_num, "top_logprobs_num")
    generation, batched = await _generation(ctx, req)
    logprobs = (req.return_logprob, req.top_logprobs_num)
    if req.stream:
        if batched:
            generation.group.abort()
            raise bad_request("stream takes one prompt with n=1", "stream")
        return with_ignored_fields(StreamingResponse(_stream(generation, logprobs),
                                                     media_type="text/event-stream"),
                                   req.ignored_fields)
    start = time.perf_counter()
    choices = await generation.collect()
    outputs = []
    for choice in choices:
        out = sglang_output(choice, *logprobs)
        out["meta_info"]["id"] = generation.id if len(choices) == 1 else f"{generation.id}-{choice.index}"
        out["meta_info"]["e2e_latency"] = round(time.perf_counter() - start, 4)
        outputs.append(out)
    entries = sum(len(c.token_ids) + len(generation.prompts[c.prompt_index]) for c in choices) \
        * (2 + req.top_logprobs_num)  # at most: an id, a logprob and the alternatives per token
    entries += sum(len(c.hidden_states) for c in choices) * LARGE_RESPONSE_ENTRIES  # rows
    response = await run_off_loop(entries, LARGE_RESPONSE_ENTRIES, _json_response,
                                  outputs if batched else outputs[0])
    return with_ignored_fields(response, req.ignored_fields)


def _tokenize(ctx: ServingContext, texts: list[str]) -> list[list[int]]:
    for text in texts:
        check_not_too_long(ctx, text, "text")
    return [ctx.tokenizer.encode(text) for text in texts]


def _json_response(content) -> JSONResponse:
    """What FastAPI makes of a returned dict or list (built off the loop when large)."""
    return JSONResponse(jsonable_encoder(content))


async def _stream(generation: Generation, logprobs) -> AsyncIterator[bytes]:
    """SGLang's stream: each event holds everything so far (cumulative text and ids)."""
    try:
        async for choice, output in generation.stream():
            if output.more:  # a verified row's tokens go out as one event
                continue
            # With hidden states, each event holds every row so far: rendered off the loop.
            event = await run_off_loop(len(choice.hidden_states) * LARGE_RESPONSE_ENTRIES,
                                       LARGE_RESPONSE_ENTRIES, _event, choice, logprobs)
            if output.error is not None:
                yield sse_error(generation_error(output.error))
            yield event
    except EngineDeadError as error:
        yield sse_error(APIError(503, str(error)))
    yield SSE_DONE


def _event(choice, logprobs) -> bytes:
    return sse(sglang_output(choice, *logprobs))


@router.get("/health")
async def health(request: Request):
    ctx = _ctx(request)
    if ctx.draining:  # a load balancer sends no more requests here
        raise shutting_down()
    if not ctx.ready:
        raise APIError(503, "the server is starting: the model is not ready yet")
    if not ctx.core.is_alive():  # a multi-host group broke, the watchdog, or a crash
        raise APIError(503, ctx.core.stopped_reason())
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request):
    """Generates one token (an embedding server: embeds one): checks that the engine loop really
    runs, not only the HTTP server."""
    ctx = _ctx(request)
    if not ctx.ready:
        raise APIError(503, "the server is starting: the model is not ready yet")
    embeds = ctx.core.features.pooling is not None
    params = SamplingParams() if embeds else SamplingParams(max_new_tokens=1, temperature=0.0)
    try:
        await Generation(ctx, [[0]], params, 1, priority=1 << 20, embed=embeds,
                         operation="health_generate").collect()
    except (APIError, EngineDeadError) as error:
        raise APIError(503, f"the engine cannot generate: {error}") from None
    return Response(status_code=200)


@router.post("/flush_cache")
async def flush_cache(request: Request):
    core = _ctx(request).core
    flush = getattr(core, "flush_cache", None)
    if flush is not None:  # without a prefix cache nothing is kept to flush
        await asyncio.to_thread(flush)  # waits for the engine thread to empty the tree
    return Response("Cache flushed.\n", status_code=200)


@router.get("/v1/models")
async def list_models(request: Request):
    ctx = _ctx(request)
    return {"object": "list", "data": [_model_card(ctx)] + _adapter_cards(ctx)}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request):
    ctx = _ctx(request)
    if not ctx.serves(model):  # an alias (--model-path as given) answers with the served card
        for card in _adapter_cards(ctx):
            if model in (card["id"], f"{ctx.served_model_name}:{card['id']}"):
                return card
        raise APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
    return _model_card(ctx)


def _adapter_cards(ctx: ServingContext) -> list[dict]:
    """The loaded LoRA adapters as vLLM lists them: their name, their path's public name as
    `root`, the served model as `parent`."""
    lora = ctx.core.features.lora
    return [] if lora is None else [
        {"id": a.name, "object": "model", "created": ctx.created, "owned_by": "xlaserve",
         "root": public_name(a.path), "parent": ctx.served_model_name,
         "max_model_len": ctx.context_length} for a in lora.cards()]


def _model_card(ctx: ServingContext) -> dict:
    return {"id": ctx.served_model_name, "object": "model", "created": ctx.created,
            "owned_by": "xlaserve", "root": ctx.model_name, "max_model_len": ctx.context_length}
