"""Rerank and score routes (issue 54): a query against documents, each pair's relevance score.

- `POST /v1/rerank` (SGLang's): `{query, documents, top_n?, return_documents?, instruct?}` ->
  a list sorted by score, each `{score, document?, index, meta_info}`.
- `POST /rerank`, `/v2/rerank` (vLLM's, in Jina's and Cohere's shape): the same body ->
  `{id, model, usage, results: [{index, document: {text}?, relevance_score}]}`, sorted.
- `POST /score`, `/v1/score` (vLLM's): `text_1` (one text, or a list) and `text_2` (a list, or
  one text): pairs of text_1 with each text_2, or element by element for two lists of one length
  -> `{id, object: "list", model, data: [{index, object: "score", score}], usage}` in order.

How a pair is scored depends on the model the server runs:
- a reranker (a cross-encoder, or a decoder with a yes/no head or a one-label score head:
  weights/classifier_head.py; a classifier of several labels answers 400): the pair tokenized
  together as the model was trained (`tokenizer(query, document)`: a BERT pair's
  document is token type 1), one request per pair, the head on its pooled row;
- an embedding model (no head): the cosine similarity of the two texts' embeddings, as vLLM
  scores with one.
A generation server answers 400. Bounds: --max-sequences-per-request documents (pairs), each
pair within the context (400 `context_length_exceeded` otherwise); `top_n` >= 1.
"""
from __future__ import annotations

import time
import uuid
from typing import Optional, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from xlaserve.http.pooling.embeddings import (check_input_ids, embed_inputs, embedding_server,
                                     input_id_lists)
from xlaserve.http.errors import bad_request
from xlaserve.http.protocol import RequestBody
from xlaserve.http.request_fields import with_ignored_fields
from xlaserve.http.serving import ServingContext, client_priority, parse_off_loop

router = APIRouter()


class RerankRequest(RequestBody):
    """SGLang's V1RerankReqInput and vLLM's (Jina / Cohere) rerank body, in one."""

    query: str
    documents: list[str] = Field(min_length=1)
    model: Optional[str] = None
    top_n: Optional[int] = None
    return_documents: bool = True
    instruct: Optional[str] = None  # SGLang: a decoder reranker's instruction (its template's)
    priority: Optional[int] = None


class ScoreRequest(RequestBody):
    """vLLM's score body."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    model: Optional[str] = None
    priority: Optional[int] = None


def _pair_inputs(ctx: ServingContext, queries: list[str], documents: list[str], param: str,
                 instruct: str | None = None):
    """Each pair's token ids as the model reads a pair, and where its second text starts (the
    tokens of token type 1; 0 where the tokenizer gives no types). A decoder reranker's pair
    is its --chat-template rendered (messages [query, document], `instruct`), where given."""
    id_lists, segments = [], []
    template = ctx.chat_template if ctx.core.loaded.config.encoder is None else None
    if instruct is not None and template is None:
        raise bad_request("instruct needs a reranker prompt template (a decoder reranker's "
                          "--chat-template), which this server does not have: put the "
                          "instruction in the query", "instruct")
    for query, document in zip(queries, documents, strict=True):
        if template is not None:
            text = ctx.tokenizer.apply_chat_template(
                [{"role": "user", "content": query}, {"role": "user", "content": document}],
                chat_template=template, tokenize=False,
                **({} if instruct is None else {"instruct": instruct}))
            encoded = {"input_ids": ctx.tokenizer.encode(text, add_special_tokens=False)}
        else:
            encoded = ctx.tokenizer(query, document)
        ids = list(encoded["input_ids"])
        types = list(encoded.get("token_type_ids") or ())
        segments.append(types.index(1) if 1 in types else 0)
        check_input_ids(ctx, ids, param)
        id_lists.append(ids)
    return id_lists, segments


async def score_pairs(ctx: ServingContext, queries: list[str], documents: list[str],
                      priority: int, param: str, instruct: str | None = None
                      ) -> tuple[np.ndarray, int]:
    """(float32 [pairs] scores, tokens read) of (queries[i], documents[i]) (module docstring)."""
    embedding_server(ctx)
    if ctx.tokenizer is None:
        raise bad_request("scoring texts needs the tokenizer (--skip-tokenizer-init is set)")
    limit = ctx.core.limits.max_sequences_per_request
    if len(queries) > limit:
        raise bad_request(f"{len(queries)} pairs; at most {limit} per request "
                          "(--max-sequences-per-request)", param)
    head = ctx.core.features.classifier_head
    if head is not None and len(head.labels) != 1:
        raise bad_request(f"this server's classifier has {len(head.labels)} labels: scoring "
                          "pairs needs a one-label head (a reranker); /classify answers its "
                          "labels", param)
    if head is not None:
        id_lists, segments = _pair_inputs(ctx, queries, documents, param, instruct)
        choices = await embed_inputs(ctx, id_lists, priority, segments)
        return head.scores(np.stack([c.embedding for c in choices])), sum(map(len, id_lists))
    # An embedding model: each distinct text embedded once, pairs by cosine similarity.
    texts = list(dict.fromkeys(queries + documents))
    id_lists = input_id_lists(ctx, texts, param)
    choices = await embed_inputs(ctx, id_lists, priority)
    vectors = {t: np.asarray(c.embedding, np.float64) for t, c in zip(texts, choices)}
    scores = [vectors[q] @ vectors[d] / max(np.linalg.norm(vectors[q]) *
                                            np.linalg.norm(vectors[d]), 1e-12)
              for q, d in zip(queries, documents)]
    return np.asarray(scores, np.float32), sum(map(len, id_lists))


async def _ranked(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_off_loop(await request.body(), RerankRequest, ctx.request_fields)
    ctx.adapters_of(req.model, None)
    if req.top_n is not None and req.top_n < 1:
        raise bad_request("top_n must be at least 1", "top_n")
    if req.instruct is not None and ctx.core.features.classifier_head is None:
        raise bad_request("instruct is a decoder reranker's; this server's model is not one",
                          "instruct")
    scores, tokens = await score_pairs(ctx, [req.query] * len(req.documents), req.documents,
                                       client_priority(ctx, req.priority), "documents",
                                       req.instruct)
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:req.top_n]
    return ctx, req, scores, tokens, order


@router.post("/v1/rerank")
async def rerank_sglang(request: Request):
    """SGLang's answer: a list sorted by score."""
    ctx, req, scores, tokens, order = await _ranked(request)
    results = []
    for i in order:
        item = {"score": float(scores[i]), "index": i}
        if req.return_documents:
            item["document"] = req.documents[i]
        results.append(item)
    return with_ignored_fields(JSONResponse(results), req.ignored_fields)


@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank_jina(request: Request):
    """vLLM's answer, Jina's and Cohere's shape."""
    ctx, req, scores, tokens, order = await _ranked(request)
    results = []
    for i in order:
        item = {"index": i, "relevance_score": float(scores[i])}
        if req.return_documents:
            item["document"] = {"text": req.documents[i]}
        results.append(item)
    return with_ignored_fields(JSONResponse({
        "id": f"rerank-{uuid.uuid4().hex}", "model": ctx.served_model_name,
        "usage": {"total_tokens": tokens}, "results": results}), req.ignored_fields)


@router.post("/score")
@router.post("/v1/score")
async def score(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_off_loop(await request.body(), ScoreRequest, ctx.request_fields)
    ctx.adapters_of(req.model, None)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not first or not second:
        raise bad_request("text_1 and text_2 must not be empty", "text_1" if not first else "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(second) == 1:
        second = second * len(first)
    elif len(first) != len(second):
        raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one "
                          "text_1, or as many as text_2", "text_2")
    scores, tokens = await score_pairs(ctx, first, second, client_priority(ctx, req.priority),
                                       "text_2")
    return with_ignored_fields(JSONResponse({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": ctx.served_model_name,
        "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}),
        req.ignored_fields)
