"""BatchRunner: the asyncio worker behind /v1/batches.

    validating -> in_progress -> finalizing -> completed
    validating -> failed                      (the input is not a valid JSONL file of requests)
    validating | in_progress -> cancelling -> cancelled

Each status change is saved in SQLite (storage.py) as it happens. Lines run through the live
endpoints' code (lines.py) at most `concurrency` at a time for the whole server, below
interactive requests in priority. A finished line is appended to the batch's output (or error)
blob, in groups: one write and fsync per group, then the counts are saved. The blobs become
files (`output_file_id`, `error_file_id`) when the batch ends; the output is kept on cancel.

Resuming: at start every batch that was not finished runs again, skipping the custom_ids its
blobs already hold; its counts are read back from them. A line that was running at the crash
has no result yet, so it runs again, once: exactly one result per custom_id.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

from xlaserve.http.batches.lines import Line, encode, endpoint_of, read_input, read_results, run_line
from xlaserve.http.errors import APIError, bad_request, not_supported
from xlaserve.http.batches.files import FileStore
from xlaserve.http.protocol import BatchRequest
from xlaserve.http.serving import ServingContext
from xlaserve.http.batches.storage import Storage, new_id
from xlaserve.runtime.engine.async_requests import EngineDeadError
from xlaserve.runtime.engine.pooled_outputs import EMBEDS, GENERATES

logger = logging.getLogger(__name__)

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
COMPLETION_WINDOW_S = 24 * 3600


def default_concurrency(max_running_requests: int) -> int:
    """Batch lines in flight: all running slots but an eighth (at least one), which stay free
    for interactive requests, so a chat request never waits for a batch line to end."""
    return max(1, max_running_requests - max(1, max_running_requests // 8))


def _zero_usage() -> dict:
    return {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


def _add_usage(total: dict, result: dict) -> None:
    usage = result["response"]["body"].get("usage") or {}
    total["input_tokens"] += usage.get("prompt_tokens", 0)
    total["output_tokens"] += usage.get("completion_tokens", 0)
    total["total_tokens"] += usage.get("total_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    total["input_tokens_details"]["cached_tokens"] += cached


def public(batch: dict) -> dict:
    """The batch object as OpenAI shows it (private bookkeeping keys start with '_')."""
    return {k: v for k, v in batch.items() if not k.startswith("_")}


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")


class _Run:
    """A batch being worked on in this process."""

    def __init__(self, batch: dict):
        self.batch = batch
        self.halted = asyncio.Event()  # set by cancel and by shutdown
        self.shutdown = False  # halted by a server stop: leave the batch as it is, to resume
        self.in_flight: set[asyncio.Task] = set()
        self.finished: list[tuple[bool, dict]] = []  # results not yet written
        self.wake = asyncio.Event()
        self.closing = False
        self.task: asyncio.Task | None = None


class BatchRunner:
    def __init__(self, ctx: ServingContext, storage: Storage, *, max_file_size: int,
                 max_lines: int, concurrency: int):
        self.ctx = ctx
        self.storage = storage
        self.files = FileStore(storage, max_file_size)
        self.max_lines = max_lines
        self.concurrency = concurrency
        self._runs: dict[str, _Run] = {}
        self._slots: asyncio.Semaphore | None = None

    # --- lifecycle (the app's lifespan) -------------------------------------------------------

    def start(self) -> None:
        """Resumes the unfinished batches (each waits for the engine's warm-up first)."""
        self._slots = asyncio.Semaphore(self.concurrency)
        for batch in self.storage.batches_with_status(ACTIVE):
            logger.info("Resuming batch %s (%s)", batch["id"], batch["status"])
            self._launch(batch)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stops the runs where they are (what finished is written; the rest resumes at the
        next start) and closes the storage."""
        runs = list(self._runs.values())
        for run in runs:
            run.shutdown = True
            run.halted.set()
        if runs:
            _, late = await asyncio.wait([r.task for r in runs], timeout=timeout)
            for task in late:
                task.cancel()
        self.storage.close()

    def lines_in_flight(self) -> int:
        """Lines running now, all batches together (the graceful shutdown waits for them)."""
        return sum(len(run.in_flight) for run in self._runs.values())

    # --- what the routes call -------------------------------------------------------------------

    def create(self, req: BatchRequest) -> dict:
        endpoint = endpoint_of(req.endpoint)
        if endpoint is None:
            raise bad_request(f"endpoint must be /v1/chat/completions, /v1/completions or "
                              f"/v1/embeddings; got {req.endpoint!r}", "endpoint")
        if (endpoint == "/v1/embeddings") != (self.ctx.core.features.pooling is not None):
            # What the server is not (an embedding server's lines would all fail, and so
            # would a generation server's embeddings): refused before any line runs.
            raise bad_request(GENERATES if self.ctx.core.features.pooling is None else EMBEDS, "endpoint")
        if req.completion_window != "24h":
            raise bad_request("completion_window must be '24h'", "completion_window")
        if req.output_expires_after is not None:
            raise not_supported("output_expires_after")
        metadata = req.metadata or {}
        if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
            raise bad_request("metadata takes at most 16 pairs, keys up to 64 characters and values "
                              "up to 512", "metadata")
        record = self.storage.file(req.input_file_id)
        if record is None:
            raise APIError(404, f"No such File object: {req.input_file_id}", param="input_file_id",
                           code="file_not_found")
        if record["purpose"] != "batch":
            raise bad_request(f"the input file's purpose is {record['purpose']!r}; upload it with "
                              "purpose 'batch'", "input_file_id")
        now = int(time.time())
        batch = {
            "id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": req.input_file_id, "completion_window": req.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": req.metadata, "model": self.ctx.served_model_name, "usage": _zero_usage(),
            # Where results go while it runs; they are listed as files when it ends.
            "_output": new_id("file-"), "_errors": new_id("file-"),
        }
        self.storage.save_batch(batch)
        self._launch(batch)
        return public(batch)

    def get(self, batch_id: str) -> dict:
        run = self._runs.get(batch_id)
        batch = run.batch if run is not None else self.storage.batch(batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        return public(batch)

    def list(self, after: str | None, limit: int) -> dict:
        try:
            batches, has_more = self.storage.batches(after=after, limit=limit)
        except KeyError:
            raise batch_not_found(after) from None
        data = [self.get(b["id"]) for b in batches]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    def cancel(self, batch_id: str) -> dict:
        """Marks the batch `cancelling` and stops its run: queued lines never start, running
        ones are aborted at once; the run then writes `cancelled` with what had finished."""
        self.get(batch_id)
        run = self._runs.get(batch_id)
        batch = run.batch if run is not None else self.storage.batch(batch_id)
        if batch["status"] == "cancelling":
            return public(batch)
        if batch["status"] not in ("validating", "in_progress") or run is None:
            raise bad_request(f"the batch is {batch['status']}: only a validating or in_progress "
                              "batch can be cancelled", "batch_id")
        self._set(batch, "cancelling")
        run.halted.set()
        return public(batch)

    def batch_reading(self, file_id: str) -> str | None:
        """The id of an unfinished batch whose input is `file_id`, if any."""
        for run in self._runs.values():
            if run.batch["input_file_id"] == file_id:
                return run.batch["id"]
        return None

    # --- a run ----------------------------------------------------------------------------------

    def _set(self, batch: dict, status: str, **fields) -> None:
        batch.update(fields, status=status)
        batch[f"{status}_at"] = int(time.time())
        self.storage.save_batch(batch)

    def _launch(self, batch: dict) -> None:
        run = _Run(batch)
        self._runs[batch["id"]] = run
        run.task = asyncio.get_running_loop().create_task(self._drive(run))
        run.task.add_done_callback(lambda _: self._runs.pop(batch["id"], None))

    async def _drive(self, run: _Run) -> None:
        batch = run.batch
        try:
            while not self.ctx.ready:  # resumed at start: wait for the warm-up
                if run.shutdown:  # the server stopped before its warm-up passed
                    return
                await asyncio.sleep(0.1)
            lines = None
            if batch["status"] in ("validating", "in_progress"):
                lines, errors = await self._read_input(batch)
                if errors and batch["status"] != "cancelling":
                    self._set(batch, "failed", errors={"object": "list", "data": errors})
                    return
                batch["request_counts"]["total"] = len(lines)
            if batch["status"] == "validating" and not run.halted.is_set():
                self._set(batch, "in_progress")
            if batch["status"] == "in_progress" and not run.halted.is_set():
                await self._run_lines(run, lines)
            if self.ctx.draining:  # the server stops: the lines not run go at the next start
                run.shutdown = True
            if not run.shutdown:
                await self._finalize(batch)
        except Exception as error:  # a bug or a full disk: fail this batch, not the server
            logger.exception("batch %s failed", batch["id"])
            self._set(batch, "failed", errors={"object": "list", "data": [
                {"code": "internal_error", "message": f"{type(error).__name__}: {error}",
                 "param": None, "line": None}]})

    async def _read_input(self, batch: dict) -> tuple[list[Line], list[dict]]:
        try:
            path = self.files.path(batch["input_file_id"])
        except APIError as error:  # deleted while the server was down
            return [], [{"code": "file_not_found", "message": error.message, "param": "input_file_id",
                         "line": None}]

        def read():
            with open(path, "rb") as f:
                return read_input(f.read(), batch["endpoint"], self.max_lines)

        return await asyncio.to_thread(read)

    def _paths(self, batch: dict) -> tuple[str, str]:
        return self.storage.blob_path(batch["_output"]), self.storage.blob_path(batch["_errors"])

    async def _recount(self, batch: dict) -> set[str]:
        """Counts and usage from what the blobs hold; -> the custom_ids already done."""
        out_path, err_path = self._paths(batch)
        outputs, failures = await asyncio.to_thread(
            lambda: (read_results(out_path), read_results(err_path)))
        usage = _zero_usage()
        for result in outputs:
            _add_usage(usage, result)
        batch["request_counts"].update(completed=len(outputs), failed=len(failures))
        batch["usage"] = usage
        self.storage.save_batch(batch)
        return {r["custom_id"] for r in outputs} | {r["custom_id"] for r in failures}

    async def _run_lines(self, run: _Run, lines: list[Line]) -> None:
        batch = run.batch
        done = await self._recount(batch)
        todo = [line for line in lines if line.custom_id not in done]
        if done:
            logger.info("Batch %s: %d of %d requests already done", batch["id"], len(done), len(lines))
        out_path, err_path = self._paths(batch)
        with open(out_path, "ab") as out, open(err_path, "ab") as err:
            writer = asyncio.create_task(self._writer(run, out, err))
            halted = asyncio.ensure_future(run.halted.wait())
            try:
                for line in todo:
                    if not await self._take_slot(run):
                        break
                    task = asyncio.create_task(self._line(run, line))
                    run.in_flight.add(task)
                    task.add_done_callback(lambda t: (run.in_flight.discard(t), self._slots.release()))
                while run.in_flight and not run.halted.is_set():
                    await asyncio.wait([*run.in_flight, halted], return_when=asyncio.FIRST_COMPLETED)
            finally:
                halted.cancel()
                for task in run.in_flight:
                    task.cancel()  # aborts its generation (run_line)
                await asyncio.gather(*run.in_flight, return_exceptions=True)
                run.closing = True
                run.wake.set()
                await writer

    async def _take_slot(self, run: _Run) -> bool:
        """Waits for a free line slot of the server; False if the run is halted, or the server
        starts draining (shutdown.py), meanwhile."""
        if run.halted.is_set() or self.ctx.draining:
            return False
        if not self._slots.locked():
            await self._slots.acquire()  # free: returns without waiting
            return True
        acquire = asyncio.ensure_future(self._slots.acquire())
        halted = asyncio.ensure_future(run.halted.wait())
        await asyncio.wait([acquire, halted], return_when=asyncio.FIRST_COMPLETED)
        halted.cancel()
        if not acquire.done():
            acquire.cancel()
            return False
        if run.halted.is_set() or self.ctx.draining:
            self._slots.release()
            return False
        return True

    async def _line(self, run: _Run, line: Line) -> None:
        try:
            ok, result = await run_line(self.ctx, run.batch["endpoint"], line)
        except EngineDeadError as error:  # not the line's fault: stop, and resume at restart
            if self.ctx.draining:  # refused or aborted by the shutdown: the other lines finish
                return
            if not run.halted.is_set():
                logger.error("batch %s stops: %s; it resumes when the server starts again",
                             run.batch["id"], error)
                run.shutdown = True
                run.halted.set()
            return
        run.finished.append((ok, result))
        run.wake.set()

    async def _writer(self, run: _Run, out, err) -> None:
        """Appends finished results in groups (whatever finished during the last write), each
        group on disk (fsync) before the counts include it. The counts are saved at status
        changes; a resumed batch counts what its blobs hold."""
        batch = run.batch
        while True:
            await run.wake.wait()
            run.wake.clear()
            group, run.finished = run.finished, []
            if group:
                await asyncio.to_thread(_append, out, err, group)
                counts = batch["request_counts"]
                for ok, result in group:
                    counts["completed" if ok else "failed"] += 1
                    if ok:
                        _add_usage(batch["usage"], result)
            if run.closing and not run.finished:
                return

    async def _finalize(self, batch: dict) -> None:
        """Lists the output (and error) blob as files; `completed`, or `cancelled` after a cancel."""
        cancelled = batch["status"] == "cancelling"
        if not cancelled and batch["status"] != "finalizing":
            self._set(batch, "finalizing")
        await self._recount(batch)
        out_path, err_path = self._paths(batch)
        open(out_path, "ab").close()  # a batch whose every line failed has an empty output file
        self.files.register(batch["_output"], f"{batch['id']}_output.jsonl", "batch_output")
        fields = {"output_file_id": batch["_output"]}
        if batch["request_counts"]["failed"]:
            self.files.register(batch["_errors"], f"{batch['id']}_error.jsonl", "batch_output")
            fields["error_file_id"] = batch["_errors"]
        else:
            self.storage.discard_blob(batch["_errors"])
        self._set(batch, "cancelled" if cancelled else "completed", **fields)
        logger.info("Batch %s %s: %s", batch["id"], batch["status"], batch["request_counts"])


def _append(out, err, group: list[tuple[bool, dict]]) -> None:
    for f, ok in ((out, True), (err, False)):
        data = b"".join(encode(result) for good, result in group if good == ok)
        if data:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
