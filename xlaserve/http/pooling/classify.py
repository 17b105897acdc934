"""Classify and pooling routes (issue 73): a classifier's or reward model's labels for each input,
and vLLM's raw pooling output.

- `POST /classify` and `/v1/classify` with vLLM's body (`input`: a text, texts, token ids or
  lists of them; or `messages`, rendered by the chat template with `add_generation_prompt`
  false by default) -> `{id, object: "list", created, model, data: [{index, label, probs,
  num_classes}], usage}`, vLLM's and SGLang's shape. `probs` are the logits through the
  checkpoint's activation (weights/classifier_head.py: a softmax over several labels, a sigmoid
  for one label or multi-label classification, the identity for regression), as vLLM's are;
  `use_activation: false` (vLLM's; its older `activation` and `softmax` too) gives the logits.
  SGLang's /v1/classify always takes a softmax, which for a one-label reward model is [1.0]: the
  checkpoint's activation is what vLLM answers and what the model was trained with.
- `POST /classify` with SGLang's native body (`text` or `input_ids`, its reward-model route) ->
  `{"embedding": [logits], "meta_info"}` per input, as /encode answers (embeddings.encoded).
- `POST /pooling` (vLLM's): the same inputs -> `{id, object: "list", created, model, data:
  [{index, object: "pooling", data}], usage}`: a classifier's `probs` (as /classify's), an
  embedding model's vector (as /v1/embeddings': `dimensions`), float or base64.

Bounds as /v1/embeddings': --max-sequences-per-request inputs, each within the vocabulary and the
context (or its last `truncate_prompt_tokens`); a chat form's tools as on chat. A generation
server answers 400, /classify on an embedding model too.
"""
from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from xlaserve.http.chat import message_chars, render_chat
from xlaserve.http.disconnect import until_disconnect
from xlaserve.http.errors import bad_request, not_supported
from xlaserve.http.images import image_parts
from xlaserve.http.pooling.embeddings import (Inputs, check_input_ids, embedding_server, encoded,
                                              input_id_lists, matryoshka_width, output_vector,
                                              truncation)
from xlaserve.http.protocol import ChatMessage, RequestBody
from xlaserve.http.request_fields import with_ignored_fields
from xlaserve.http.serving import (LARGE_PROMPT_CHARS, Generation, ServingContext,
                                   client_priority, parse_off_loop, run_off_loop)
from xlaserve.runtime.sampling.params import SamplingParams

router = APIRouter()


class ClassifyRequest(RequestBody):
    """vLLM's ClassificationCompletionRequest, ClassificationChatRequest and PoolingRequest, and
    SGLang's ClassifyRequest and native reward body (EmbeddingReqInput), in one: exactly one of
    `input`, `messages`, `text` and `input_ids`."""

    model: Optional[str] = None
    input: Optional[Inputs] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    text: Optional[Union[str, list[str]]] = None  # SGLang's native body
    input_ids: Optional[Union[list[int], list[list[int]]]] = None  # SGLang's native body
    add_special_tokens: Optional[bool] = None  # None: true for `input`, false for `messages`
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None
    activation: Optional[bool] = None  # vLLM's older names for use_activation
    softmax: Optional[bool] = None
    encoding_format: Literal["float", "base64"] = "float"  # /pooling
    dimensions: Optional[int] = None  # /pooling, on an embedding model
    user: Optional[str] = None  # OpenAI's end-user id: accepted, not used
    priority: Optional[int] = None
    # The chat form, as /tokenize's.
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: Optional[str] = None  # refused, as on /tokenize
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None


def _activated(req: ClassifyRequest) -> bool:
    """Whether to apply the head's activation: `use_activation`, or its older names (default
    true); two that disagree are a 400."""
    given = {name: value for name in ("use_activation", "activation", "softmax")
             if (value := getattr(req, name)) is not None}
    if len(set(given.values())) > 1:
        raise bad_request(f"{' and '.join(given)} disagree: give use_activation alone",
                          "use_activation")
    return next(iter(given.values()), True)


def _id_lists(ctx: ServingContext, req: ClassifyRequest) -> list[list[int]]:
    """The inputs as token id lists, each checked (embeddings.input_id_lists); the chat form
    rendered by the server's chat template."""
    if req.messages is None:
        return input_id_lists(ctx, req.input, "input", req.add_special_tokens is not False,
                              truncation(ctx, req.truncate_prompt_tokens))
    if ctx.tokenizer is None:
        raise bad_request("messages need the tokenizer (--skip-tokenizer-init is set)", "messages")
    if req.chat_template is not None:
        raise not_supported("chat_template", "chat_template in a request (start the server with "
                                             "--chat-template)")
    if image_parts(req.messages):
        raise not_supported("messages", "image parts on a pooling model")
    ids = render_chat(ctx, req, add_generation_prompt=req.add_generation_prompt,
                      add_special_tokens=req.add_special_tokens is True).ids
    if (truncate := truncation(ctx, req.truncate_prompt_tokens)) is not None:
        ids = ids[-truncate:]
    check_input_ids(ctx, ids, "messages")
    return [ids]


async def _parsed(request: Request) -> tuple[ServingContext, ClassifyRequest]:
    ctx: ServingContext = request.app.state.ctx
    return ctx, await parse_off_loop(await request.body(), ClassifyRequest, ctx.request_fields)


async def _pooled(request: Request, ctx: ServingContext, req: ClassifyRequest) -> tuple[list, list]:
    """(the inputs' id lists, their Choices) of a vLLM-form body."""
    ctx.adapters_of(req.model, None)
    embedding_server(ctx)
    if req.text is not None or req.input_ids is not None:
        raise bad_request("text and input_ids are SGLang's /classify body; here give input or "
                          "messages", "text" if req.text is not None else "input_ids")
    if (req.input is None) == (req.messages is None):
        raise bad_request("give exactly one of input and messages", "input")
    size = message_chars(req) if req.messages is not None else LARGE_PROMPT_CHARS
    id_lists = await run_off_loop(size, LARGE_PROMPT_CHARS, _id_lists, ctx, req)
    generation = Generation(ctx, id_lists, SamplingParams(), 1, embed=True,
                            operation="embeddings",
                            priority=client_priority(ctx, req.priority))
    choices = await until_disconnect(request, generation.collect(), generation.group.abort)
    return id_lists, choices


def _usage(id_lists: list[list[int]]) -> dict:
    tokens = sum(map(len, id_lists))
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _head(ctx: ServingContext):
    head = ctx.core.features.classifier_head
    if head is None:
        raise bad_request("this server's model has no classifier head: /classify needs a "
                          "*ForSequenceClassification checkpoint (a classifier or reward model)")
    return head


@router.post("/classify")
@router.post("/v1/classify")
async def classify(request: Request):
    ctx, req = await _parsed(request)
    sglang_native = req.text is not None or req.input_ids is not None
    if request.url.path == "/classify" and sglang_native:  # SGLang's reward body
        if req.input is not None or req.messages is not None:
            raise bad_request("give one of input, messages, text and input_ids", "input")
        return with_ignored_fields(JSONResponse(await encoded(ctx, req)), req.ignored_fields)
    id_lists, choices = await _pooled(request, ctx, req)
    head = _head(ctx)
    logits = head.logits(np.stack([c.embedding for c in choices]))
    probs = head.probabilities(logits) if _activated(req) else logits
    data = [{"index": i, "label": head.labels[int(np.argmax(row))], "probs": p.tolist(),
             "num_classes": len(head.labels)} for i, (row, p) in enumerate(zip(logits, probs))]
    return with_ignored_fields(JSONResponse({
        "id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": ctx.served_model_name, "data": data, "usage": _usage(id_lists)}),
        req.ignored_fields)


@router.post("/pooling")
async def pooling(request: Request):
    """vLLM's: each input's pooled output, a classifier's probabilities or an embedding."""
    ctx, req = await _parsed(request)
    id_lists, choices = await _pooled(request, ctx, req)
    vectors = np.stack([c.embedding for c in choices])
    if (head := ctx.core.features.classifier_head) is not None:
        if req.dimensions is not None:
            raise bad_request("dimensions are an embedding model's; this server runs a "
                              "classifier", "dimensions")
        logits = head.logits(vectors)
        outputs = list(head.probabilities(logits) if _activated(req) else logits)
    else:
        pooling = ctx.core.features.pooling
        width = matryoshka_width(pooling, ctx.core.loaded.config.hidden_size, req.dimensions)
        outputs = [output_vector(v, width, pooling.normalize) for v in vectors]
    data = [{"index": i, "object": "pooling",
             "data": (base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
                      if req.encoding_format == "base64" else np.asarray(v).tolist())}
            for i, v in enumerate(outputs)]
    return with_ignored_fields(JSONResponse({
        "id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": ctx.served_model_name, "data": data, "usage": _usage(id_lists)}),
        req.ignored_fields)
