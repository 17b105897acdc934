"""Continuous batching on the host: which requests run which tokens in the next step.

Pure bookkeeping (no JAX, no model), driven by the engine thread:

    batch = scheduler.schedule()                  # decodes first, then prefill chunks
    tokens = run the model on batch.chunks
    finished = scheduler.process_results(batch, tokens)

A request's KV state is `num_computed`: how many of `all_ids()` are in the cache. It is
*decoding* when everything but the last sampled token is computed; otherwise it is prefilling
`all_ids()[num_computed:]`, in chunks. When the page pool runs dry for the decodes, the newest
running requests are retracted: pages dropped, generated tokens kept, and on re-admission their
prompt plus output so far is prefilled again (retraction.py; docs/internals.md, Memory).

Prefix cache: an admitted request starts at its longest cached prefix, and its whole pages enter
the radix tree as steps complete them (prefix_cache.py; prefix_reuse.py, PrefixReuse).
"""
from __future__ import annotations

import bisect
import itertools
import logging

from xlaserve.runtime.scheduler.host_tier import HostTier
from xlaserve.runtime.scheduler.page_allocator import PageAllocator, pages_for_tokens
from xlaserve.runtime.scheduler.prefix_cache import RadixCache
from xlaserve.runtime.scheduler.prefix_reuse import PrefixReuse
from xlaserve.runtime.scheduler.request import (DecodeChunks, DecodeRows, Request, RequestTooLong,
                                               SampledRow, ScheduledBatch, SeqChunk)
from xlaserve.runtime.scheduler.retraction import retract_for_decodes, retract_for_prefills
from xlaserve.runtime.scheduler.speculation import DraftTree, Speculator
from xlaserve.runtime.scheduler.step_log import StepLog

logger = logging.getLogger(__name__)


def prefill_budget(max_prefill_tokens: int, num_decodes: int) -> int:
    """Prompt tokens a step may run beside `num_decodes` decode rows. As in SGLang's mixed
    chunks, decodes take their share of `max_prefill_tokens`, so a mixed step is no bigger than a
    prefill step (and pads to the same bucket, not the next one up); prompts keep at least a
    quarter of it, so new requests still start under a full decode load."""
    return max(max_prefill_tokens - num_decodes, max_prefill_tokens // 4, 1)


def max_step_tokens(max_running_requests: int, max_prefill_tokens: int) -> int:
    """The most tokens one step can hold (`prefill_budget` beside every running request decoding,
    or a whole prefill step): the largest padding bucket the executor compiles. A step with
    speculative verified rows holds at most `max_running_requests` tokens
    (Speculator.drafts)."""
    return max(max_prefill_tokens,
               max_running_requests + prefill_budget(max_prefill_tokens, max_running_requests))


class NoSpeculation:
    """The Speculator (speculation.py) of a server without speculative decoding: decodes draft
    nothing, so no row verifies drafts and any step may be a continuation."""

    verifies = False
    drafter = None

    def drafts(self, scheduler, decoding: list[Request]) -> list[list[int]]:
        return [[] for _ in decoding]

    def reads_first(self, scheduler, batch) -> bool:
        return False

    def stats(self) -> dict:
        return {}


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_running_requests: int,
                 chunked_prefill_size: int | None, max_prefill_tokens: int, context_length: int,
                 log_interval: int = 40, radix_cache: bool = True,
                 speculator: Speculator | NoSpeculation | None = None, host_pages: int = 0):
        """`speculator`: --speculative-algorithm's (speculation.py; None: NoSpeculation).
        `host_pages`: the prefix cache's host tier (host_tier.py; 0: none)."""
        if max_running_requests < 1 or max_prefill_tokens < 1:
            raise ValueError("max_running_requests and max_prefill_tokens must be at least 1")
        self.allocator = allocator
        self.page_size = page_size
        self.cache = RadixCache(allocator, page_size,
                                HostTier(host_pages) if host_pages else None)
        self.prefix = PrefixReuse(self.cache, page_size, enabled=radix_cache)
        self.max_running_requests = max_running_requests
        # <= 0 or None: no chunking, a prompt runs in one step.
        self.chunk_size = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.max_prefill_tokens = max_prefill_tokens
        self.context_length = context_length
        self.log = StepLog(log_interval)  # SGLang's Prefill batch / Decode batch lines
        self.speculator = speculator or NoSpeculation()
        self.waiting: list[Request] = []  # kept sorted by _queue_key
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.requests: dict[str, Request] = {}  # every unfinished request, by rid
        self._free_slots = list(range(max_running_requests, 0, -1))  # pop() hands out low ids first
        self._arrivals = itertools.count()
        self._arrival_order: dict[str, int] = {}

    # --- queue --------------------------------------------------------------------------------

    @property
    def max_request_tokens(self) -> int:
        """The longest prompt + output one request may have: the context length, or what the
        whole KV pool holds if that is less (the last sampled token needs no KV)."""
        return min(self.context_length, self.allocator.capacity * self.page_size + 1)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, pooled: bool = False) -> None:
        """The one decision whether a request could ever run, whatever else is going on: the
        engine's admission check (runtime/engine/admission.py) asks it before a request is built, and
        `add` again for direct callers. Raises RequestTooLong (a ValueError) for a prompt plus
        max_new_tokens over `max_request_tokens`, ValueError for an empty prompt or no tokens.
        `pooled`: an embedding request (no tokens; its whole prompt goes into the KV cache)."""
        if prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        if max_new_tokens < (0 if pooled else 1):
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        total = prompt_tokens + max_new_tokens
        limit = self.max_request_tokens
        if pooled:  # every token's KV is kept until the last chunk
            limit = min(self.context_length, self.allocator.capacity * self.page_size)
        if total <= limit:
            return
        if total > self.context_length:
            message = (f"the prompt ({prompt_tokens} tokens) plus max_new_tokens "
                       f"({max_new_tokens}) is {total} tokens, more than the context length "
                       f"({self.context_length})")
        elif pooled:
            message = (f"the input ({prompt_tokens} tokens) needs "
                       f"{pages_for_tokens(total, self.page_size)} KV pages but the whole pool "
                       f"has {self.allocator.capacity} pages "
                       f"({self.allocator.capacity * self.page_size} tokens)")
        else:  # the last sampled token never enters the cache: the KV peaks at total - 1 tokens
            message = (f"the request needs {pages_for_tokens(total - 1, self.page_size)} KV pages "
                       f"({total - 1} tokens) but the whole pool has {self.allocator.capacity} "
                       f"pages ({self.allocator.capacity * self.page_size} tokens)")
        where = "context length" if limit == self.context_length else "KV cache capacity"
        raise RequestTooLong(message, prompt_tokens, max_new_tokens, limit, where)

    def add(self, request: Request) -> None:
        self.check_fits(len(request.prompt_ids), request.max_new_tokens, request.pooled)
        if request.rid in self.requests:
            raise ValueError(f"request id {request.rid!r} is already in use")
        request.status = "waiting"
        self.requests[request.rid] = request
        self._arrival_order[request.rid] = next(self._arrivals)
        self._enqueue(request)

    def _queue_key(self, request: Request):
        # Priority first; within it, retracted requests go to the front so they resume first,
        # then first come first served (arrival order breaks equal timestamps).
        return (-request.priority, request.retracted_count == 0, request.arrival_time,
                self._arrival_order[request.rid])

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._queue_key)

    # --- leaving ------------------------------------------------------------------------------

    def abort(self, rid: str) -> Request | None:
        return self.finish(rid, "abort", None)

    def abort_many(self, rids) -> None:
        """Aborts these requests (unknown ids are skipped) with one pass over the queue, where
        `abort` one by one would search it once each."""
        requests = list({rid: r for rid in rids if (r := self.requests.get(rid)) is not None}.values())
        waiting = {r.rid for r in requests if r.status == "waiting"}
        if waiting:
            self.waiting = [r for r in self.waiting if r.rid not in waiting]
        for request in requests:
            if request.status != "waiting":
                self.running.remove(request)
                self._release(request)
            self._end(request, "abort", None)

    def finish(self, rid: str, reason: str, matched: int | str | None = None) -> Request | None:
        """Ends a request now (stop string, abort): its pages and slot are free at once."""
        request = self.requests.get(rid)
        if request is None:
            return None
        if request.status == "waiting":
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self._release(request)
        self._end(request, reason, matched)
        return request

    def _end(self, request: Request, reason: str, matched: int | str | None) -> None:
        del self.requests[request.rid]
        del self._arrival_order[request.rid]
        request.status = "finished"
        request.finish_reason = (reason, matched)

    def _release(self, request: Request) -> None:
        """Its computed whole pages stay cached (unlocked by it); the rest go back to the free list."""
        self.prefix.share_computed_pages(request)
        self.cache.unlock(request.cache_node)
        self.allocator.free(request.page_ids[request.cache_node.prefix_pages:])
        request.page_ids, request.cache_node = [], None
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None

    # --- scheduling ---------------------------------------------------------------------------

    def new_pages(self, request: Request, kv_len: int) -> int:
        """Pages the request lacks for `kv_len` tokens of KV."""
        return max(0, pages_for_tokens(kv_len, self.page_size) - len(request.page_ids))

    def grow(self, request: Request, kv_len: int) -> None:
        """Gives the request the pages `kv_len` tokens of KV need (the caller checked they are
        free). Most decode steps need no new page (one in page_size): no allocator call."""
        if (new := self.new_pages(request, kv_len)) > 0:
            request.page_ids += self.cache.allocate(new)

    def flush_cache(self) -> int:
        """Evicts every cached page that no running request uses; returns how many."""
        return self.cache.flush()

    def schedule(self) -> ScheduledBatch | None:
        rows = self._schedule_decodes()
        num_decodes = len(rows)
        admitted: list[Request] = []
        decode_tokens = num_decodes + sum(c.num_drafts for _, c in rows)
        rows += self._schedule_prefills(admitted, budget=prefill_budget(self.max_prefill_tokens,
                                                                        decode_tokens))
        if not rows and self.running:  # only prefills run, and none gets pages: retract
            rows = retract_for_prefills(self, admitted)
        if not rows:
            return None
        requests = [r for r, _ in rows]
        chunks = [c for _, c in rows]
        kind = "decode" if num_decodes == len(rows) else "prefill" if num_decodes == 0 else "mixed"
        cached = sum(c.num_cached for r, c in rows if any(r is a for a in admitted))
        self.log.step(self, kind, num_decodes, chunks[num_decodes:], cached)
        return ScheduledBatch(requests, chunks, [r.slot for r in requests], kind, admitted)

    def _schedule_decodes(self) -> list[tuple[Request, SeqChunk]]:
        """One token for every decoding request; retracts the newest running requests when the
        pool cannot give every decode the page it may need."""
        decoding = [r for r in self.running if r.is_decoding]
        needed = sum(self.new_pages(r, r.num_computed + 1) for r in decoding)
        if needed > self.cache.available_pages and len(self.running) > 1:
            decoding = retract_for_decodes(self)
        drafts = self.speculator.drafts(self, decoding)
        rows = []
        for r, draft in zip(decoding, drafts):
            self.grow(r, r.num_computed + 1 + len(draft))
            tree = isinstance(draft, DraftTree)
            rows.append((r, SeqChunk([r.output_ids[-1], *(draft.tokens if tree else draft)],
                                     r.num_computed, list(r.page_ids), True,
                                     num_drafts=len(draft),
                                     tree_parents=[-1, *draft.parents] if tree else None)))
        return rows

    def _schedule_prefills(self, admitted: list[Request], budget: int, admit: bool = True,
                           only_waiting: bool = False) -> list[tuple[Request, SeqChunk]]:
        """Chunks of unfinished prompts: running ones first (unless `only_waiting`), then new
        admissions in queue order, within `budget` prompt tokens and the free pages. Stops at the
        first request that does not fit, so a big request at the head of the queue is not
        starved by smaller ones."""
        rows = []
        running = [] if only_waiting else [r for r in self.running if not r.is_decoding]
        candidates = running + (list(self.waiting) if admit else [])
        for r in candidates:
            is_new = r.status == "waiting"
            if is_new:
                if len(self.running) >= self.max_running_requests:
                    break
                self.prefix.attach(r)
                if self.prefix.waits_for_a_running_prefill(r, self.running):
                    self.prefix.detach(r)
                    continue
            remaining = r.num_tokens - r.num_computed
            n = min(remaining, budget, self.chunk_size or remaining)
            # Without chunking, a prompt over the budget runs alone, in a step of its own.
            alone = n < remaining and self.chunk_size is None
            n = remaining if alone else n
            if (alone and rows) or n <= 0 or self.new_pages(r, r.num_computed + n) > self.cache.available_pages:
                if is_new:
                    self.prefix.detach(r)
                break
            if is_new:
                self.waiting.remove(r)
                r.status = "running"
                r.slot = self._free_slots.pop()
                self.running.append(r)
                admitted.append(r)
                if r.retracted_count == 0:
                    r.num_cached_prompt_tokens = r.num_computed
            self.grow(r, r.num_computed + n)
            ids = r.all_ids()
            token_ids = ids[r.num_computed:r.num_computed + n]
            rows.append((r, SeqChunk(token_ids, r.num_computed, list(r.page_ids), n == remaining,
                                     next_token=ids[r.num_computed + n] if n < remaining else -1)))
            budget -= n
        return rows

    def schedule_continuation(self, batch: ScheduledBatch) -> ScheduledBatch | None:
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
        if self.speculator.reads_first(self, batch):
            return None
        admissible = self.waiting and len(self.running) < self.max_running_requests
        if batch.decode is not None and not admissible:
            return self._continue_decodes(batch)
        if not all(c.sample for c in batch.chunks):
            return None
        if admissible and sum(r.status == "running" for r in batch.requests) != len(self.running):
            return None
        # Per row, once: the KV length after this step and the pages that needs (one loop, no
        # calls: this runs for every row of every decode step, ~1 ms at 256 rows before).
        page_size = self.page_size
        rows, needed = [], 0
        for r, c in zip(batch.requests, batch.chunks, strict=True):
            if r.status == "running" and len(r.output_ids) + 1 < r.max_new_tokens:
                num_cached = c.num_cached + len(c.token_ids)
                new = -(-(num_cached + 1) // page_size) - len(r.page_ids)
                rows.append((r, num_cached, new))
                needed += max(new, 0)
        if (not rows and not admissible) or needed > self.cache.available_pages:
            return None
        requests, chunks = [], []
        for r, num_cached, new in rows:
            if new > 0:
                r.page_ids += self.cache.allocate(new)
            requests.append(r)
            chunks.append(SeqChunk([0], num_cached, list(r.page_ids), True, input_slot=r.slot))
        admitted: list[Request] = []
        prefills = []
        if admissible:  # every running request is in `batch`: none has a prompt chunk to run
            prefills = self._schedule_prefills(
                admitted, budget=prefill_budget(self.max_prefill_tokens, len(rows)),
                only_waiting=True)
        if not requests and not prefills:
            return None
        requests += [r for r, _ in prefills]
        chunks += [c for _, c in prefills]
        kind = "decode" if not prefills else "prefill" if not rows else "mixed"
        prefills = chunks[len(rows):]
        self.log.step(self, kind, len(rows), prefills, sum(c.num_cached for c in prefills))
        slots = [r.slot for r in requests]
        decode = None if prefills else DecodeRows(
            [c.num_cached for c in chunks], slots, [len(r.output_ids) for r in requests],
            [c.page_ids for c in chunks])
        # `ahead` is the decode rows' (input_slot >= 0); an admitted row has sampled nothing.
        return ScheduledBatch(requests, chunks, slots, kind, admitted, ahead=1, decode=decode)

    def _continue_decodes(self, batch: ScheduledBatch) -> ScheduledBatch | None:
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
        page_size = self.page_size
        # Row i's KV grows to num_cached + 1 tokens: a new page where num_cached fills its last
        # page; a page completed by the last results processed where num_cached % page_size == 1.
        growing = [i for i, c in enumerate(num_cached) if c % page_size == 0]
        new_pages = [self.new_pages(requests[i], num_cached[i] + 1) for i in growing]
        if sum(new_pages) > self.cache.available_pages:
            return None
        for i, new in zip(growing, new_pages):
            if new > 0:
                requests[i].page_ids += self.cache.allocate(new)
        changed = sorted({*growing, *(i for i, c in enumerate(num_cached) if c % page_size == 1)})
        for i in changed:
            page_ids[i] = list(requests[i].page_ids)
        rows = DecodeRows(num_cached, slots, output_lens, page_ids, previous, kept)
        # Rows of a batch with no grammar (or logprobs) have none: `False and None` is False;
        # where the batch had some (or was not asked), the rows left are asked again (None).
        self.log.step(self, "decode", len(requests), [], 0)
        return ScheduledBatch(requests, DecodeChunks(rows), slots, "decode", [], ahead=1,
                              decode=rows, has_grammar=batch.has_grammar and None,
                              has_logprobs=batch.has_logprobs and None)

    def process_results(self, batch: ScheduledBatch, sampled_tokens: list[int],
                        sampled: list[SampledRow] | None = None) -> list[Request]:
        """Advances every row by its chunk; rows that sampled get their token. Returns the
        requests that finished (their pages and slots are already free). With `sampled`, each
        row that sampled for a running request is appended to it as a SampledRow, in row order."""
        finished = []
        sampled = [] if sampled is None else sampled
        if batch.decode is not None:  # one token a row: whole pages complete every page_size
            page_size, share = self.page_size, self.prefix.share_computed_pages
            for i, (request, token) in enumerate(zip(batch.requests, sampled_tokens, strict=True)):
                if request.status == "running":
                    request.num_computed += 1
                    if request.num_computed % page_size == 0:
                        share(request)
                    output = request.output_ids
                    if (token in request.stop_token_ids or request.grammar is not None
                            or len(output) + 1 >= request.max_new_tokens):
                        self.take_token(request, token, finished)
                    else:  # the common row, without a call (~0.1 ms of 256 rows)
                        output.append(token)
                    sampled.append(SampledRow(request, token, i, len(output)))
            return finished
        row = 0  # each chunk's first sample row: one per chunk, and one per draft it verifies
        for request, chunk in zip(batch.requests, batch.chunks, strict=True):
            i, row = row, row + 1 + chunk.num_drafts
            token = sampled_tokens[i]
            if request.status != "running":
                continue  # aborted or finished since it was scheduled
            if chunk.num_drafts:
                self.speculator.take_verified(self, request, chunk, sampled_tokens[i:row], i,
                                              finished, sampled)
                continue
            request.num_computed += len(chunk.token_ids)
            self.prefix.share_computed_pages(request)
            if chunk.sample:
                token = int(token)
                self.take_token(request, token, finished)
                sampled.append(SampledRow(request, token, i, len(request.output_ids)))
        if row != len(sampled_tokens):
            raise ValueError(f"{len(sampled_tokens)} sampled tokens for {row} sample rows")
        return finished

    def process_pooled(self, batch: ScheduledBatch) -> list[int]:
        """An embedding server's step (every row a prompt chunk of a pooled request): each
        running request advances by its chunk, and the chunk that ends its prompt finishes it
        ("stop": nothing is sampled; its pages and slot are free). Returns those rows."""
        ended = []
        for i, (request, chunk) in enumerate(zip(batch.requests, batch.chunks, strict=True)):
            if request.status != "running":
                continue  # aborted since it was scheduled
            request.num_computed += len(chunk.token_ids)
            self.prefix.share_computed_pages(request)
            if chunk.sample:
                self.finish(request.rid, "stop", None)
                ended.append(i)
        return ended

    def take_token(self, request: Request, token: int, finished: list[Request]) -> None:
        """Appends a sampled token to a running request, ending it (into `finished`) where the
        token does: a stop id, the grammar's end or refusal, the length."""
        # A stop id counts only where the sampler would not have suppressed it.
        stops = token in request.stop_token_ids and len(request.output_ids) >= request.min_new_tokens
        request.output_ids.append(token)
        if stops and request.grammar is not None and not request.grammar.accepts():
            # The mask allows a stop only where the grammar accepts, or (llguidance) where no
            # token continues it: an output that does not satisfy its constraint, never a "stop".
            request.error = request.grammar.dead_end()
            finished.append(self.finish(request.rid, "abort", None))
        elif stops:
            finished.append(self.finish(request.rid, "stop", token))
        elif request.grammar is not None and not request.grammar.consume(token):
            # A dead end (only EOS allowed, not a stop id: ignore_eos) or a bug; never an answer.
            logger.warning("request %s: its grammar rejected token %d (%s)", request.rid, token,
                           request.grammar.error().split("\n", 1)[0])
            request.error = request.grammar.dead_end()
            finished.append(self.finish(request.rid, "abort", None))
        elif request.grammar is not None and request.grammar.is_stopped():
            # Complete (e.g. a JSON object's closing brace): "stop", with no stop token.
            finished.append(self.finish(request.rid, "stop", None))
        elif len(request.output_ids) >= request.max_new_tokens:
            finished.append(self.finish(request.rid, "length", None))

    def suppressed_ids(self, request: Request, ahead: int = 0) -> list[int]:
        """Stop ids the sampler must not pick yet (min_new_tokens), for the token sampled
        `ahead` tokens after the output so far (ScheduledBatch.ahead)."""
        if len(request.output_ids) + ahead < request.min_new_tokens:
            return sorted(request.stop_token_ids)
        return []

    # --- state and logs -----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_pages_in_use(self) -> int:
        """Pages that running requests hold (cached pages nobody uses count as free, as in SGLang)."""
        return self.allocator.num_used - self.cache.evictable_pages

    def token_usage(self) -> float:
        return self.num_pages_in_use / self.allocator.capacity

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)
