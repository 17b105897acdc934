"""Stored responses and the background ones running: `ResponseStore`.

A stored response is its `response` object plus `_input`, the conversation it answered (the
input items of its previous_response_id chain, then its own), in the SQLite storage of files
and batches (batches/storage.py), so previous_response_id and retrieve work across restarts.
`store: false` responses are never written.

Background responses (`background: true`) run as asyncio tasks of this process; their record is
saved `in_progress` at once and again when they end (completed, incomplete, failed, cancelled).
A server that stops fails the ones still running; at start, records a crash left `queued` or
`in_progress` are failed the same way, since nothing runs them any more.

Reads and writes run in a worker thread (Storage is thread-safe): a record holds the whole
conversation, and an 8 MB one took 21 ms to save (fsync'd) and 16 ms to load, which on the event
loop would stall every stream (a small one: 0.3 ms and 0.07 ms; 2-core CPU, local disk).
"""
from __future__ import annotations

import asyncio
import logging

from xlaserve.http.batches.storage import Storage
from xlaserve.http.errors import APIError, bad_request
from xlaserve.http.responses.call import ResponseCall

logger = logging.getLogger(__name__)

UNFINISHED = ("queued", "in_progress")
STOPPED_ERROR = {"code": "server_error",
                 "message": "the server stopped before the response was finished"}


def public(record: dict) -> dict:
    """The response object as OpenAI shows it (private keys start with '_')."""
    return {k: v for k, v in record.items() if not k.startswith("_")}


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id '{response_id[:64]}' not found.", param=param,
                    code="response_not_found")


class ResponseStore:
    def __init__(self, storage: Storage):
        self.storage = storage
        self._running: dict[str, tuple[asyncio.Task, ResponseCall]] = {}
        self._generating: set[str] = set()  # running ones still generating (cancellable)
        self._cancelled: set[str] = set()  # running ones a cancel (or the stop) ended
        self._stopping = False
        for record in storage.responses_with_status(UNFINISHED):
            logger.info("Response %s was %s when the server stopped: failed", record["id"],
                        record["status"])
            self.storage.save_response({**record, "status": "failed", "error": STOPPED_ERROR})

    async def save(self, call: ResponseCall, response: dict) -> None:
        if call.req.store:
            await asyncio.to_thread(self.storage.save_response, {**response, "_input": call.input})

    async def record(self, response_id: str, param: str = "response_id") -> dict:
        record = await asyncio.to_thread(self.storage.response, response_id)
        if record is None:
            raise not_found(response_id, param)
        return record

    async def previous(self, response_id: str | None) -> dict | None:
        """The finished record previous_response_id names, or None without one."""
        if response_id is None:
            return None
        record = await self.record(response_id, "previous_response_id")
        if record["status"] in UNFINISHED:
            raise bad_request(f"the previous response {response_id} is {record['status']}: wait "
                              "for it to finish", "previous_response_id")
        return record

    async def delete(self, response_id: str) -> dict:
        if response_id in self._running:
            raise bad_request("the response is still running: cancel it first", "response_id")
        if not await asyncio.to_thread(self.storage.delete_response, response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # --- background ---------------------------------------------------------------------------

    async def start_background(self, call: ResponseCall) -> dict:
        """Saves the submitted call `in_progress` and finishes it in a task: -> that object."""
        response = call.object("in_progress")
        await self.save(call, response)
        task = asyncio.get_running_loop().create_task(self._finish(call))
        self._running[call.id] = (task, call)
        return response

    async def _finish(self, call: ResponseCall) -> None:
        """Generates, then saves the final record. The save is never cancelled (cancel and stop
        cancel only the generation), so the record is final when the task ends."""
        response = None if call.id in self._cancelled else await self._generate(call)
        if call.id in self._cancelled or response is None:
            response = call.object("failed", error=STOPPED_ERROR) if self._stopping \
                else call.object("cancelled")
        try:
            await self.save(call, response)
        finally:
            self._running.pop(call.id, None)
            self._cancelled.discard(call.id)

    async def _generate(self, call: ResponseCall) -> dict | None:
        """The finished response object, or None when the generation was cancelled."""
        self._generating.add(call.id)
        try:
            return call.finished(await call.chat.response())
        except asyncio.CancelledError:
            return None
        except APIError as error:
            return call.object("failed", error={"code": "server_error", "message": error.message})
        except Exception:  # a bug must still leave a final record, not `in_progress` forever
            logger.exception("Background response %s failed", call.id)
            return call.object("failed", error={"code": "server_error",
                                                "message": "internal error"})
        finally:
            self._generating.discard(call.id)

    def _interrupt(self, response_id: str) -> asyncio.Task:
        """Marks a running response cancelled, frees its slots and stops its generation."""
        task, call = self._running[response_id]
        self._cancelled.add(response_id)
        call.chat.generation.group.abort()
        if response_id in self._generating:
            task.cancel()
        return task

    async def cancel(self, response_id: str) -> dict:
        """Stops a running background response (its slots are freed at once) -> `cancelled`;
        a finished one is a 400, as OpenAI's."""
        if response_id not in self._running:
            record = await self.record(response_id)
            if not record.get("background"):
                raise bad_request("Cannot cancel a synchronous response.", "response_id")
            if record["status"] != "cancelled":
                raise bad_request(f"Cannot cancel a response that is {record['status']}.",
                                  "response_id")
            return public(record)
        await asyncio.gather(self._interrupt(response_id), return_exceptions=True)
        return public(await self.record(response_id))

    async def stop(self, timeout: float = 10.0) -> None:
        """At shutdown: the running background responses end `failed` (see the module doc)."""
        self._stopping = True
        tasks = [self._interrupt(response_id) for response_id in list(self._running)]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)


