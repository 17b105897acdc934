"""POST /v1/embeddings (OpenAI's shape) and SGLang's native /encode, on an embedding server
(--is-embedding; issue 54); on a classifier, /encode answers its head's logits (SGLang's
reward models).

`input`: a string, a list of strings, a list of token ids or a list of token-id lists; texts are
tokenized with the model's special tokens (as sentence-transformers does; vLLM's
`add_special_tokens`, default true) and lowercased first where the checkpoint says so.
`encoding_format`: "float" (a list) or "base64" (the little-endian float32 bytes, as OpenAI's
SDK decodes them). `dimensions`: Matryoshka truncation, only where the checkpoint says its
vectors allow it (weights/pooling.py), normalised again where the model normalises (vLLM's and
OpenAI's vectors stay unit length); elsewhere a 400, as vLLM answers. An input over the context
length is a 400 (`context_length_exceeded`), or keeps its last k tokens with vLLM's
`truncate_prompt_tokens` k (-1: the context length). Bounds: --max-sequences-per-request inputs,
each within the vocabulary and the context. A generation server answers 400.
"""
from __future__ import annotations

import base64
from typing import Literal, Optional, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from xlaserve.http.disconnect import until_disconnect
from xlaserve.http.errors import bad_request
from xlaserve.http.prompt_bound import check_not_too_long
from xlaserve.http.protocol import RequestBody
from xlaserve.http.request_fields import with_ignored_fields
from xlaserve.http.serving import (Generation, ServingContext, check_prompt_ids, client_priority,
                                   context_error, parse_off_loop)
from xlaserve.runtime.engine.pooled_outputs import GENERATES
from xlaserve.runtime.sampling.params import SamplingParams
from xlaserve.runtime.scheduler.request import RequestTooLong

router = APIRouter()

Inputs = Union[str, list[str], list[int], list[list[int]]]


class EmbeddingRequest(RequestBody):
    """OpenAI's embeddings body, with vLLM's `truncate_prompt_tokens` and `add_special_tokens`
    and SGLang's `priority`."""

    input: Inputs
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None  # OpenAI's end-user id: accepted, not used
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True
    priority: Optional[int] = None


class EncodeRequest(RequestBody):
    """SGLang's native /encode body (EmbeddingReqInput): `text` or `input_ids`, one or a list."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    model: Optional[str] = None
    priority: Optional[int] = None


def embedding_server(ctx: ServingContext):
    """The server's pooling; a generation server's 400."""
    pooling = ctx.core.features.pooling
    if pooling is None:
        raise bad_request(GENERATES)
    return pooling


def input_id_lists(ctx: ServingContext, inputs: Inputs, param: str, add_special_tokens: bool = True,
                   truncate: int | None = None) -> list[list[int]]:
    """The four input forms as token id lists (texts tokenized, lowercased where the model
    says), each checked: not empty, in the vocabulary, within the context (or its last
    `truncate` tokens kept)."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise bad_request(f"{param} is empty", param)
    limit = ctx.core.limits.max_sequences_per_request
    if len(inputs) > limit:
        raise bad_request(f"{len(inputs)} inputs; at most {limit} per request "
                          "(--max-sequences-per-request)", param)
    lowercase = ctx.core.features.pooling.lowercase
    id_lists = []
    for item in inputs:
        if isinstance(item, str):
            if ctx.tokenizer is None:
                raise bad_request("text inputs need the tokenizer (--skip-tokenizer-init is set)",
                                  param)
            if not item:
                raise bad_request(f"{param} holds an empty string", param)
            if truncate is None:
                check_not_too_long(ctx, item, param)
            ids = ctx.tokenizer.encode(item.lower() if lowercase else item,
                                       add_special_tokens=add_special_tokens)
        else:
            ids = list(item)
        if truncate is not None:
            ids = ids[-truncate:]
        check_input_ids(ctx, ids, param)
        id_lists.append(ids)
    return id_lists


def check_input_ids(ctx: ServingContext, ids: list[int], param: str) -> None:
    """One input's ids: not empty, in the vocabulary, within the context (a 400 naming
    `param`, `context_length_exceeded` for the length)."""
    check_prompt_ids(ctx, ids, param)
    try:
        ctx.core.check_embedding_input(len(ids))
    except RequestTooLong as error:
        raise context_error(error, param) from None


def truncation(ctx: ServingContext, tokens: int | None) -> int | None:
    """vLLM's truncate_prompt_tokens: -1 is the context length; k keeps an input's last k."""
    if tokens is None:
        return None
    limit = ctx.core.max_request_tokens
    if tokens == -1:
        return limit
    if not 1 <= tokens <= limit:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {limit}] (the tokens an "
                          f"input may hold), got {tokens}", "truncate_prompt_tokens")
    return tokens


def matryoshka_width(pooling, hidden: int, dimensions: int | None) -> int | None:
    """The Matryoshka width asked for (None: the whole vector), checked against the model."""
    if dimensions is None or dimensions == hidden:
        return None
    widths = pooling.matryoshka_dimensions
    if widths is None:
        raise bad_request("this model does not support Matryoshka representations: dimensions "
                          "other than its width would give vectors it was not trained to give",
                          "dimensions")
    if not 1 <= dimensions <= hidden or (widths and dimensions not in widths):
        allowed = ", ".join(map(str, widths)) if widths else f"1 to {hidden}"
        raise bad_request(f"dimensions must be one of the model's widths ({allowed}), got "
                          f"{dimensions}", "dimensions")
    return dimensions


def output_vector(embedding: np.ndarray, width: int | None, normalize: bool) -> np.ndarray:
    vector = np.asarray(embedding, np.float32)
    if width is not None:
        vector = vector[:width]
        if normalize:
            vector = vector / max(np.float32(np.linalg.norm(vector)), np.float32(1e-12))
    return vector


async def embed_inputs(ctx: ServingContext, id_lists: list[list[int]], priority: int,
                       second_segments: list[int] | None = None):
    """Each input's Choice, in order, its `embedding` (float32 [hidden]) in;
    `second_segments`: Generation's (a cross-encoder's pairs)."""
    generation = Generation(ctx, id_lists, SamplingParams(), 1, priority=priority, embed=True,
                            second_segments=second_segments, operation="embeddings")
    return await generation.collect()


class EmbeddingCall:
    """One /v1/embeddings request, checked and submitted (`create`), answered (`response`): the
    route's, and a batch line's (http/batches/lines.py, as ChatCall and CompletionCall)."""

    def __init__(self, ctx: ServingContext, req: EmbeddingRequest):
        ctx.adapters_of(req.model, None)  # a model not served: the 404
        self.pooling = embedding_server(ctx)
        if ctx.core.features.classifier_head is not None:
            raise bad_request("this server runs a classifier: it scores (/classify, /v1/rerank, "
                              "/score), it gives no embeddings")
        self.ctx, self.req = ctx, req
        self.width = matryoshka_width(self.pooling, ctx.core.loaded.config.hidden_size,
                                      req.dimensions)
        self.id_lists = input_id_lists(ctx, req.input, "input", req.add_special_tokens,
                                       truncation(ctx, req.truncate_prompt_tokens))
        self.generation: Generation | None = None

    @classmethod
    async def create(cls, ctx: ServingContext, req: EmbeddingRequest,
                     priority: int | None = None) -> "EmbeddingCall":
        """Checks the request and submits its inputs; `priority`: a batch line's (else the
        request's own, `client_priority`)."""
        call = cls(ctx, req)
        call.generation = Generation(
            ctx, call.id_lists, SamplingParams(), 1, embed=True, operation="embeddings",
            priority=client_priority(ctx, req.priority) if priority is None else priority)
        return call

    async def response(self) -> dict:
        """OpenAI's embeddings object, once every input is in."""
        data = []
        for index, choice in enumerate(await self.generation.collect()):
            vector = output_vector(choice.embedding, self.width, self.pooling.normalize)
            data.append({"object": "embedding", "index": index,
                         "embedding": (base64.b64encode(vector.astype("<f4").tobytes()).decode()
                                       if self.req.encoding_format == "base64"
                                       else vector.tolist())})
        tokens = sum(map(len, self.id_lists))
        return {"object": "list", "data": data, "model": self.ctx.served_model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_off_loop(await request.body(), EmbeddingRequest, ctx.request_fields)
    call = await EmbeddingCall.create(ctx, req)
    content = await until_disconnect(request, call.response(), call.generation.group.abort)
    return with_ignored_fields(JSONResponse(content), req.ignored_fields)


@router.post("/encode")
async def encode(request: Request):
    """SGLang's /encode: `{"embedding": [float], "meta_info": {...}}`, or a list of them."""
    ctx: ServingContext = request.app.state.ctx
    req = await parse_off_loop(await request.body(), EncodeRequest, ctx.request_fields)
    return with_ignored_fields(JSONResponse(await encoded(ctx, req)), req.ignored_fields)


async def encoded(ctx: ServingContext, req) -> dict | list[dict]:
    """SGLang's /encode answer to `req` (its `text` or `input_ids`; /classify's SGLang form too):
    each input's pooled vector, or on a classifier (a reward model) its head's logits, as SGLang
    returns a reward model's score in `embedding`."""
    ctx.adapters_of(req.model, None)
    embedding_server(ctx)
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    inputs, param = (req.text, "text") if req.text is not None else (req.input_ids, "input_ids")
    batched = not (isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)))
    id_lists = input_id_lists(ctx, inputs, param)
    choices = await embed_inputs(ctx, id_lists, client_priority(ctx, req.priority))
    vectors = [np.asarray(c.embedding, np.float32) for c in choices]
    if (head := ctx.core.features.classifier_head) is not None:
        vectors = list(head.logits(np.stack(vectors)))
    outputs = [{"embedding": v.tolist(), "meta_info": c.finish.meta_info()}
               for v, c in zip(vectors, choices)]
    return outputs if batched else outputs[0]
