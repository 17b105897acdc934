"""Retraction: when the page pool runs dry, the scheduler takes the newest running requests back
to the queue. A retracted request's pages are dropped (its computed whole pages stay in the prefix
cache, unlocked) and its generated tokens kept; it goes to the front of its priority in the queue
and on re-admission its prompt plus output so far is prefilled again (docs/internals.md,
Memory). A plain request's step never runs this: the Scheduler calls it only under memory
pressure, and logs SGLang's line for it under the scheduler's logger name."""
from __future__ import annotations

import logging
from typing import Protocol

from xlaserve.runtime.scheduler.prefix_cache import RadixCache
from xlaserve.runtime.scheduler.request import Request, SeqChunk

logger = logging.getLogger("xlaserve.runtime.scheduler.scheduler")  # the line's name, as before


class _Scheduler(Protocol):
    """What retraction uses of the scheduler (which calls it: not imported here)."""

    running: list[Request]
    cache: RadixCache
    max_prefill_tokens: int

    def _release(self, request: Request) -> None: ...

    def _enqueue(self, request: Request) -> None: ...

    def new_pages(self, request: Request, kv_len: int) -> int: ...

    def schedule_prefills(self, admitted: list[Request], budget: int,
                           admit: bool = True) -> list[tuple[Request, SeqChunk]]: ...


def retract(scheduler: _Scheduler, request: Request) -> None:
    scheduler.running.remove(request)
    scheduler._release(request)
    request.num_computed = 0  # recomputed from prompt + output so far on re-admission
    request.retracted_count += 1
    request.status = "waiting"
    scheduler._enqueue(request)


def retract_for_decodes(scheduler: _Scheduler) -> list[Request]:
    """Retracts the newest running requests until the pool can give every decoding request the
    page it may need, or one request is left; returns the decoding requests then. Called when
    it cannot now and more than one request runs."""
    num_retracted = 0
    while True:
        retract(scheduler, scheduler.running[-1])
        num_retracted += 1
        decoding = [r for r in scheduler.running if r.is_decoding]
        needed = sum(scheduler.new_pages(r, r.num_computed + 1) for r in decoding)
        if needed <= scheduler.cache.available_pages or len(scheduler.running) <= 1:
            break
    logger.info("KV cache pool is full. Retract requests. #retracted_reqs: %d", num_retracted)
    return decoding


def retract_for_prefills(scheduler: _Scheduler,
                         admitted: list[Request]) -> list[tuple[Request, SeqChunk]]:
    """Only prefilling requests are running and none can get pages: retracts the newest until
    the others' prompt chunks fit (a lone request always fits, `Scheduler.add` checked) and
    returns their rows. No admissions, or the retracted one would take its pages right back."""
    rows: list[tuple[Request, SeqChunk]] = []
    while not rows and scheduler.running:
        retract(scheduler, scheduler.running[-1])
        logger.info("KV cache pool is full. Retract requests. #retracted_reqs: 1")
        rows = scheduler.schedule_prefills(admitted, budget=scheduler.max_prefill_tokens,
                                            admit=False)
    return rows


def retract_running(scheduler: _Scheduler) -> int:
    """Takes every running request back to the queue (pause_generation's retract mode; a
    release of the KV cache), newest first; returns how many. No step may be in flight."""
    count = len(scheduler.running)
    while scheduler.running:
        retract(scheduler, scheduler.running[-1])
    return count
