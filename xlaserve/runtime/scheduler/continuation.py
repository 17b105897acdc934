"""The overlap's next step: scheduled while the last one runs, before its tokens are read. The
engine loop dispatches it before reading the last one (EngineCore._loop), so the device goes from
one step to the next without waiting for the host (docs/internals.md, Overlap). The Scheduler
calls this with itself (`Scheduler.schedule_continuation`), as retraction.py's."""
from __future__ import annotations

from typing import Any, Protocol

from xlaserve.runtime.scheduler.request import (DecodeChunks, DecodeRows, Request, ScheduledBatch,
                                               SeqChunk)


class _Scheduler(Protocol):
    """What a continuation uses of the scheduler (which calls it: not imported here)."""

    waiting: list[Request]
    running: list[Request]
    max_running_requests: int
    max_prefill_tokens: int
    page_size: int
    cache: Any  # prefix_cache.RadixCache
    log: Any  # scheduler.StepLog
    speculator: Any  # speculation.Speculator or scheduler.NoSpeculation

    def new_pages(self, request: Request, kv_len: int) -> int: ...

    def prefill_budget(self, num_decodes: int) -> int: ...

    def schedule_prefills(self, admitted: list[Request], budget: int, admit: bool = True,
                          only_waiting: bool = False) -> list[tuple[Request, SeqChunk]]: ...


def schedule_continuation(scheduler: _Scheduler, batch: ScheduledBatch) -> ScheduledBatch | None:
    """The step after `batch`, scheduled while `batch` still runs (its tokens unread): each of
    its requests decodes the token `batch` samples, which the step reads from the device
    (`SeqChunk.input_slot`), and waiting requests are admitted beside them (their prompts
    need nothing from `batch`) within the prefill budget, the free slots and pages. None when
    the next step should be scheduled the usual way, after the results: `batch` has a prompt
    chunk that samples nothing, a running request is not in it (a prompt the budget left
    out: its next chunk is scheduled with the results), or the pool lacks a page for the
    decodes (retraction needs the results).

    A request that `batch` ends by length is left out. One that it ends by a stop id (or
    that a stop string or an abort ends meanwhile) runs one row too many: `process_results`
    drops that row, and freeing its pages (or slot) is safe because the device runs steps
    in order, so whoever gets them next writes after this step. Its slot and pages are not
    free for this step's admissions yet: those take what is free now."""
    if scheduler.speculator.reads_first(scheduler, batch):
        return None
    admissible = scheduler.waiting and len(scheduler.running) < scheduler.max_running_requests
    if batch.decode is not None and not admissible:
        return _continue_decodes(scheduler, batch)
    if not all(c.sample for c in batch.chunks):
        return None
    if admissible and sum(r.status == "running" for r in batch.requests) != len(scheduler.running):
        return None
    # Per row, once: the KV length after this step and the pages that needs (one loop, no
    # calls: this runs for every row of every decode step, ~1 ms at 256 rows before).
    page_size = scheduler.page_size
    rows, needed = [], 0
    for r, c in zip(batch.requests, batch.chunks, strict=True):
        if r.status == "running" and len(r.output_ids) + 1 < r.max_new_tokens:
            num_cached = c.num_cached + len(c.token_ids)
            new = -(-(num_cached + 1) // page_size) - len(r.page_ids)
            rows.append((r, num_cached, new))
            needed += max(new, 0)
    if (not rows and not admissible) or needed > scheduler.cache.available_pages:
        return None
    requests, chunks = [], []
    snapshots = scheduler.prefix.decode_snapshots([r for r, *_ in rows],
                                                  [num_cached + 1 for _, num_cached, _ in rows])
    for i, (r, num_cached, new) in enumerate(rows):
        if new > 0:
            r.page_ids += scheduler.cache.allocate(new)
        requests.append(r)
        chunks.append(SeqChunk([0], num_cached, list(r.page_ids), True, input_slot=r.slot,
                               snapshot=snapshots.get(i)))
    admitted: list[Request] = []
    prefills = []
    if admissible:  # every running request is in `batch`: none has a prompt chunk to run
        prefills = scheduler.schedule_prefills(admitted, budget=scheduler.prefill_budget(len(rows)),
                                               only_waiting=True)
    if not requests and not prefills:
        return None
    requests += [r for r, _ in prefills]
    chunks += [c for _, c in prefills]
    kind = "decode" if not prefills else "prefill" if not rows else "mixed"
    prefills = chunks[len(rows):]
    scheduler.log.step(scheduler, kind, len(rows), prefills, sum(c.num_cached for c in prefills))
    slots = [r.slot for r in requests]
    decode = None if prefills else DecodeRows(
        [c.num_cached for c in chunks], slots, [len(r.output_ids) for r in requests],
        [c.page_ids for c in chunks], snapshots=snapshots)
    # `ahead` is the decode rows' (input_slot >= 0); an admitted row has sampled nothing.
    return ScheduledBatch(requests, chunks, slots, kind, admitted, ahead=1, decode=decode)


def _continue_decodes(scheduler: _Scheduler, batch: ScheduledBatch) -> ScheduledBatch | None:
    """`schedule_continuation` of a batch of decode rows only (`batch.decode`) when no
    request can be admitted: the same rows less those that ended, from the columns, with a
    page list copied only for a row that gets a page or whose whole pages may have been
    swapped for cached ones (`share_computed_pages`, when the results processed since
    completed a page). A SeqChunk per row and a copy of every page list cost ~0.5 ms of a
    256-row step's host time (benchmarks/bench_host_step.py)."""
    previous = batch.decode
    requests = batch.requests
    output_lens = [len(r.output_ids) for r in requests]
    kept = [i for i, (r, n) in enumerate(zip(requests, output_lens))
            if r.status == "running" and n + 1 < r.max_new_tokens]
    if not kept:
        return None
    if len(kept) == len(requests):
        kept = None
        num_cached = [c + 1 for c in previous.num_cached]
        slots, page_ids = previous.slots, list(previous.page_ids)
    else:
        requests = [requests[i] for i in kept]
        output_lens = [output_lens[i] for i in kept]
        num_cached = [previous.num_cached[i] + 1 for i in kept]
        slots = [previous.slots[i] for i in kept]
        page_ids = [previous.page_ids[i] for i in kept]
    page_size = scheduler.page_size
    # Row i's KV grows to num_cached + 1 tokens: a new page where num_cached fills its last
    # page; a page completed by the last results processed where num_cached % page_size == 1.
    growing = [i for i, c in enumerate(num_cached) if c % page_size == 0]
    new_pages = [scheduler.new_pages(requests[i], num_cached[i] + 1) for i in growing]
    if sum(new_pages) > scheduler.cache.available_pages:
        return None
    for i, new in zip(growing, new_pages):
        if new > 0:
            requests[i].page_ids += scheduler.cache.allocate(new)
    changed = sorted({*growing, *(i for i, c in enumerate(num_cached) if c % page_size == 1)})
    for i in changed:
        page_ids[i] = list(requests[i].page_ids)
    rows = DecodeRows(num_cached, slots, output_lens, page_ids, previous, kept,
                      scheduler.prefix.decode_snapshots(requests, [n + 1 for n in num_cached]))
    # Rows of a batch with no grammar (or logprobs) have none: `False and None` is False;
    # where the batch had some (or was not asked), the rows left are asked again (None).
    scheduler.log.step(scheduler, "decode", len(requests), [], 0)
    return ScheduledBatch(requests, DecodeChunks(rows), slots, "decode", [], ahead=1,
                          decode=rows, has_grammar=batch.has_grammar and None,
                          has_logprobs=batch.has_logprobs and None)
