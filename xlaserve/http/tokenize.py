"""POST /tokenize and /detokenize (also under /v1/): text or chat messages -> token ids, and back,
with the server's own tokenizer and chat template, in vLLM's and SGLang's shapes at once.

- /tokenize takes vLLM's completion form (`prompt`: a string) or chat form (`messages`, with
  `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`, `tools`), and
  SGLang's list of prompts (`prompt`: [str], answered with lists). It answers
  `{"count", "max_model_len", "tokens", "token_strs"}`: vLLM's fields, which hold SGLang's.
  `add_special_tokens` defaults to true for a prompt, false for messages (the template writes
  the special tokens itself), as in both.
- /detokenize takes `tokens` ([int], or SGLang's [[int]]) and answers the text as both vLLM's
  `prompt` and SGLang's `text`. Special tokens are kept unless `skip_special_tokens` is true:
  vLLM keeps them (a client counting the template's end-of-turn tokens in the text reads them),
  SGLang's default drops them; keeping them loses nothing, so ids -> text -> ids round-trips.

Bounds: a prompt, or one list of ids, is at most the tokens one request may hold
(`max_request_tokens`, what vLLM refuses too), a list at most --max-sequences-per-request
prompts, ids inside the vocabulary, tools as on chat (--max-tools). vLLM's per-request
`chat_template` is refused (vLLM refuses it too unless --trust-request-chat-template): a client's
Jinja would run in the server.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from xlaserve.http.chat import message_chars, render_chat
from xlaserve.http.errors import bad_request, not_supported
from xlaserve.http.images import image_parts
from xlaserve.http.prompt_bound import check_not_too_long
from xlaserve.http.protocol import ChatMessage, RequestBody
from xlaserve.http.request_fields import with_ignored_fields
from xlaserve.http.serving import (LARGE_PROMPT_CHARS, ServingContext, parse_off_loop,
                                   run_off_loop)

router = APIRouter()


class TokenizeRequest(RequestBody):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest, and SGLang's TokenizeRequest,
    in one body: exactly one of `prompt` and `messages`."""

    model: Optional[str] = None
    prompt: Optional[Union[str, list[str]]] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: Optional[bool] = None  # None: true for a prompt, false for messages
    return_token_strs: Optional[bool] = False  # vLLM: the tokens' strings too
    # The chat form.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None  # refused: see the module's docstring
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None  # SGLang
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None  # SGLang


class DetokenizeRequest(RequestBody):
    model: Optional[str] = None
    tokens: Union[list[int], list[list[int]]]
    skip_special_tokens: bool = False  # SGLang's field; its default there is true


async def _parsed(request: Request, model: type[RequestBody]):
    """(the body as `model`, the context) once the server can answer it."""
    ctx: ServingContext = request.app.state.ctx
    req = await parse_off_loop(await request.body(), model, ctx.request_fields)
    if ctx.tokenizer is None:  # vLLM's answer: a 400 (SGLang fails with a 500)
        raise bad_request("tokenize and detokenize need the tokenizer (the server runs with "
                          "--skip-tokenizer-init)")
    ctx.adapters_of(req.model, None)  # an adapter's name tokenizes as its base model
    return req, ctx


def _check_list_length(ctx: ServingContext, length: int, what: str, param: str) -> None:
    limit = ctx.core.limits.max_sequences_per_request
    if length > limit:
        raise bad_request(f"{length} {what}; at most {limit} per request "
                          f"(--max-sequences-per-request)", param)


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request):
    req, ctx = await _parsed(request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.chat_template is not None:
        raise not_supported("chat_template", "chat_template in a request (start the server with "
                                             "--chat-template)")
    if req.messages is not None:
        size = message_chars(req)
    else:
        if isinstance(req.prompt, list):
            _check_list_length(ctx, len(req.prompt), "prompts", "prompt")
        size = sum(map(len, req.prompt if isinstance(req.prompt, list) else [req.prompt]))
    response = await run_off_loop(size, LARGE_PROMPT_CHARS, _tokenized, ctx, req)
    return with_ignored_fields(response, req.ignored_fields)


def _tokenized(ctx: ServingContext, req: TokenizeRequest) -> JSONResponse:
    if req.messages is not None:
        if ctx.images is not None and image_parts(req.messages):
            # An image's tokens are known once it is read and resized: not here.
            raise not_supported("messages", "image parts on /tokenize (an image's token count "
                                            "is the chat completion's usage.prompt_tokens)")
        id_lists = [render_chat(ctx, req, add_generation_prompt=req.add_generation_prompt,
                                add_special_tokens=req.add_special_tokens is True).ids]
    else:
        texts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        id_lists = []
        for text in texts:
            check_not_too_long(ctx, text, "prompt")
            id_lists.append(ctx.tokenizer.encode(text, add_special_tokens=req.add_special_tokens
                                                 is not False))
    for ids in id_lists:
        _check_length(ctx, len(ids), "messages" if req.messages is not None else "prompt")
    strs = [ctx.tokenizer.convert_ids_to_tokens(ids) for ids in id_lists] \
        if req.return_token_strs else None
    if isinstance(req.prompt, list):  # SGLang's batch: a list in each field
        return JSONResponse({"count": [len(ids) for ids in id_lists],
                             "max_model_len": ctx.context_length, "tokens": id_lists,
                             "token_strs": strs})
    return JSONResponse({"count": len(id_lists[0]), "max_model_len": ctx.context_length,
                         "tokens": id_lists[0], "token_strs": strs and strs[0]})


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request):
    req, ctx = await _parsed(request, DetokenizeRequest)
    batched = bool(req.tokens) and isinstance(req.tokens[0], list)
    id_lists = req.tokens if batched else [req.tokens]
    _check_list_length(ctx, len(id_lists), "lists of tokens", "tokens")
    for ids in id_lists:
        _check_length(ctx, len(ids), "tokens")
        if any(not 0 <= t < ctx.vocab_size for t in ids):
            raise bad_request(f"token ids must be in [0, {ctx.vocab_size})", "tokens")
    texts = await run_off_loop(sum(map(len, id_lists)), _LARGE_DECODE_IDS, _decode, ctx, id_lists,
                               req.skip_special_tokens)
    text = texts if batched else texts[0]
    return with_ignored_fields(JSONResponse({"prompt": text, "text": text}),  # vLLM's, SGLang's
                               req.ignored_fields)


# Decoding 8 K ids takes about what encoding LARGE_PROMPT_CHARS (serving.py) does (1.6 ms): 0.20 us
# an id against 0.43 us a character (the default model's tokenizer, 27 K ids, 2-core CPU).
_LARGE_DECODE_IDS = 8192


def _decode(ctx: ServingContext, id_lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
    return [ctx.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in id_lists]


def _check_length(ctx: ServingContext, count: int, param: str) -> None:
    """vLLM's refusal of more tokens than the model takes, at the tokens one request may hold."""
    limit = ctx.core.max_request_tokens
    if count > limit:
        where = "context length" if limit == ctx.context_length else "KV cache capacity"
        raise bad_request(f"The input ({count} tokens) is longer than the model's {where} "
                          f"({limit} tokens).", param, code="context_length_exceeded")
