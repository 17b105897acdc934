"""An embedding server's steps in the scheduler: every row is a prompt chunk of a pooled request
(`Request.pooled`, nothing sampled), and the chunk that ends a prompt finishes its request. The
engine's PooledSteps (runtime/engine/pooled_outputs.py) calls this with the scheduler after each
step, as the generation steps call `Scheduler.process_results`."""
from __future__ import annotations

from typing import Any, Protocol

from xlaserve.runtime.scheduler.request import Request, ScheduledBatch


class _Scheduler(Protocol):
    """What a pooled step's results use of the scheduler (which is not imported here)."""

    prefix: Any  # prefix_reuse.PrefixReuse

    def finish(self, rid: str, reason: str, matched: int | str | None = None) -> Request | None: ...


def process_pooled(scheduler: _Scheduler, batch: ScheduledBatch) -> list[int]:
    """Each running request of the step advances by its chunk; the chunk that ends its prompt
    finishes it ("stop": its pages and slot are free). Returns those rows."""
    ended = []
    for i, (request, chunk) in enumerate(zip(batch.requests, batch.chunks, strict=True)):
        if request.status != "running":
            continue  # aborted since it was scheduled
        request.num_computed += len(chunk.token_ids)
        scheduler.prefix.share_computed_pages(request)
        if chunk.sample:
            scheduler.finish(request.rid, "stop", None)
            ended.append(i)
    return ended
