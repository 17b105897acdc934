"""Batches API: `POST /v1/batches`, `GET /v1/batches/{id}`, `GET /v1/batches` (newest first,
`after` + `limit`), `POST /v1/batches/{id}/cancel`. The work is done by runner.py."""
from __future__ import annotations

from fastapi import APIRouter, Request

from xlaserve.http.errors import bad_request
from xlaserve.http.batches.files import runner_of
from xlaserve.http.protocol import BatchRequest
from xlaserve.http.request_fields import parse_body

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request):
    return runner_of(request).create(parse_body(await request.body(), BatchRequest))


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20):
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", "limit")
    return runner_of(request).list(after, limit)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request):
    return runner_of(request).get(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request):
    return runner_of(request).cancel(batch_id)
