"""Files API: `POST /v1/files` (multipart `file` + `purpose`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content` (the bytes as uploaded), `DELETE /v1/files/{id}`.

`FileStore` keeps each file's bytes under `--file-storage-path` by id (storage.py); the
client's filename is only shown back. Uploads are limited to `--max-file-size` bytes (413).
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import BinaryIO

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from xlaserve.http.errors import APIError, bad_request
from xlaserve.http.batches.storage import Storage, fsync_dir, new_id

# What OpenAI accepts at upload; only `batch` files are read by this server (batch inputs).
UPLOAD_PURPOSES = ("batch", "user_data", "assistants", "fine-tune", "vision", "evals")
_FORM_OVERHEAD = 64 * 1024  # multipart boundaries and the purpose field around the file
_COPY_CHUNK = 1 << 20

router = APIRouter()


def file_object(record: dict) -> dict:
    return {"id": record["id"], "object": "file", "bytes": record["bytes"],
            "created_at": record["created_at"], "filename": record["filename"],
            "purpose": record["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def safe_filename(name: str | None) -> str:
    """The last path component of what the client called its file (shown back, never a path)."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1].strip()
    base = "".join(ch for ch in base if ch.isprintable())[:255]
    return base if base not in ("", ".", "..") else "upload"


def not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")


class FileStore:
    def __init__(self, storage: Storage, max_file_size: int):
        self.storage = storage
        self.max_file_size = max_file_size

    def save(self, source: BinaryIO, filename: str, purpose: str) -> dict:
        """Copies an upload into storage (blocking: run it in a thread). The bytes are on disk
        and fsync'd before the file is listed."""
        file_id = new_id("file-")
        temp = self.storage.temp_path()
        size = 0
        try:
            with open(temp, "wb") as out:
                while chunk := source.read(_COPY_CHUNK):
                    size += len(chunk)
                    if size > self.max_file_size:
                        raise too_large(self.max_file_size)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, self.storage.blob_path(file_id))
            fsync_dir(self.storage.files_dir)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        return self.register(file_id, filename, purpose)

    def register(self, file_id: str, filename: str, purpose: str) -> dict:
        """Lists a blob already in files/ (a batch's output) as a file."""
        record = {"id": file_id, "bytes": os.path.getsize(self.storage.blob_path(file_id)),
                  "created_at": int(time.time()), "filename": filename, "purpose": purpose}
        self.storage.add_file(record)
        return self.storage.file(file_id)

    def get(self, file_id: str) -> dict:
        record = self.storage.file(file_id)
        if record is None:
            raise not_found(file_id)
        return record

    def path(self, file_id: str) -> str:
        return self.storage.blob_path(self.get(file_id)["id"])


def too_large(limit: int) -> APIError:
    return APIError(413, f"the file is over --max-file-size ({limit} bytes)", param="file",
                    code="file_too_large")


def runner_of(request: Request):
    """The app's BatchRunner (it owns the FileStore)."""
    return request.app.state.batch_runner


def _limited(request: Request, limit: int) -> Request:
    """The request with a body that stops with a 413 once it is longer than `limit` (the
    multipart parser would otherwise spool all of it first)."""
    received = 0

    async def receive():
        nonlocal received
        message = await request.receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise too_large(limit - _FORM_OVERHEAD)
        return message

    return Request(request.scope, receive)


@router.post("/v1/files")
async def upload(request: Request):
    store: FileStore = runner_of(request).files
    limit = store.max_file_size + _FORM_OVERHEAD
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(store.max_file_size)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("upload the file as multipart/form-data with fields 'file' and 'purpose'")
    async with _limited(request, limit).form(max_files=1, max_fields=8) as form:
        file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(file, UploadFile):
            raise bad_request("the form has no 'file' part", "file")
        if purpose not in UPLOAD_PURPOSES:
            raise bad_request(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose!r}",
                              "purpose")
        record = await asyncio.to_thread(store.save, file.file, safe_filename(file.filename), purpose)
    return file_object(record)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = 10000, order: str = "desc"):
    if not 1 <= limit <= 10000:
        raise bad_request("limit must be between 1 and 10000", "limit")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    try:
        records, has_more = runner_of(request).files.storage.files(
            purpose=purpose, after=after, limit=limit, order=order)
    except KeyError:
        raise not_found(after) from None
    data = [file_object(r) for r in records]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request):
    return file_object(runner_of(request).files.get(file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request):
    return FileResponse(runner_of(request).files.path(file_id), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request):
    runner = runner_of(request)
    runner.files.get(file_id)
    active = runner.batch_reading(file_id)
    if active is not None:
        raise bad_request(f"the file is the input of batch {active}, which is still running; "
                          "cancel it first", "file_id")
    if not runner.files.storage.delete_file(file_id):
        raise not_found(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
