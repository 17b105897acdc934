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
import time

from xlaserve.runtime.scheduler.host_tier import HostTier
from xlaserve.runtime.scheduler.page_allocator import PageAllocator, pages_for_tokens
from xlaserve.runtime.scheduler.prefix_cache import RadixCache
from xlaserve.runtime.scheduler.prefix_reuse import PrefixReuse
from xlaserve.runtime.scheduler.request import (Request, RequestTooLong, SampledRow, ScheduledBatch,
                                               SeqChunk)
from xlaserve.runtime.scheduler.retraction import retract_for_decodes, retract_for_prefills
from xlaserve.runtime.scheduler.speculation import NO_DRAFT, Draft, Speculator
from xlaserve.runtime.scheduler.continuation import schedule_continuation

logger = logging.getLogger(__name__)


def prefill_budget(max_prefill_tokens: int, num_decodes: int) -> int:
    """Prompt tokens a step may run beside `num_decodes` decode rows. As in SGLang's mixed
    chunks, decodes take their share of `max_prefill_tokens`, so a mixed step is no bigger than a
    prefill step (and pads to the same bucket, not the next one up); prompts keep at least a
    quarter of it, so new requests still start under a full decode load."""
    return max(max_prefill_tokens - num_decodes, max_prefill_tokens // 4, 1)


class NoSpeculation:
    """The Speculator (speculation.py) of a server without speculative decoding: decodes draft
    nothing, so no row verifies drafts and any step may be a continuation."""

    verifies = False
    drafter = None

    def drafts(self, scheduler, decoding: list[Request]) -> list[Draft]:
        return [NO_DRAFT] * len(decoding)

    def reads_first(self, scheduler, batch) -> bool:
        return False

    def stats(self) -> dict:
        return {}


class EveryRequest:
    """The admission gate of a server whose requests need only pages and a slot to start (a LoRA
    server's also gives each an adapter slot: runtime/engine/adapter_slots.py)."""

    def admits(self, request: Request, running: list[Request]) -> bool:
        return True


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_running_requests: int,
                 chunked_prefill_size: int | None, max_prefill_tokens: int, context_length: int,
                 log_interval: int = 40, radix_cache: bool = True,
                 speculator: Speculator | NoSpeculation = NoSpeculation(), host_pages: int = 0,
                 admission=EveryRequest(), prefix_reuse=PrefixReuse):
        """`speculator`: --speculative-algorithm's (speculation.py), or NoSpeculation (stateless).
        `host_pages`: the prefix cache's host tier (host_tier.py; 0: none). `admission`: whether
        a waiting request may start now, beside pages (`admits(request, running)`).
        `prefix_reuse(cache, page_size, enabled)`: the cache's use (prefix_reuse.py; a hybrid
        model's, state_reuse.py)."""
        if max_running_requests < 1 or max_prefill_tokens < 1:
            raise ValueError("max_running_requests and max_prefill_tokens must be at least 1")
        self.allocator = allocator
        self.page_size = page_size
        self.cache = RadixCache(allocator, page_size,
                                HostTier(host_pages) if host_pages else None)
        self.prefix = prefix_reuse(self.cache, page_size, enabled=radix_cache)
        self.max_running_requests = max_running_requests
        self.chunk_size = chunked_prefill_size if (chunked_prefill_size or 0) > 0 else None
        self.max_prefill_tokens = max_prefill_tokens
        self.context_length = context_length
        self.log = StepLog(log_interval)  # SGLang's Prefill batch / Decode batch lines
        self.speculator = speculator
        self.admission = admission
        # paused: no step at all; not admitting: no waiting request starts (weight_updates.py)
        self.paused, self.admitting = False, True
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
        return RequestTooLong.token_limit(self.context_length, self.allocator.capacity,
                                          self.page_size)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, pooled: bool = False) -> None:
        """The one decision whether a request could ever run, whatever else is going on: the
        engine's admission check (runtime/engine/admission.py) asks it before a request is built, and
        `add` again for direct callers (RequestTooLong.check: `pooled`, an embedding request)."""
        RequestTooLong.check(prompt_tokens, max_new_tokens, pooled, self.context_length,
                             self.allocator.capacity, self.page_size)

    def add(self, request: Request) -> None:
        self.check_fits(len(request.prompt_ids), request.max_new_tokens,
                        request.pooled is not None)
        if request.rid in self.requests:
            raise ValueError(f"request id {request.rid!r} is already in use")
        request.status = "waiting"
        self.requests[request.rid] = request
        self._arrival_order[request.rid] = next(self._arrivals)
        self._enqueue(request)

    def _queue_key(self, request: Request):
        # Priority, then retracted requests first, then arrival (its order breaking ties).
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
        self.prefix.release(request)
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

    def prefill_budget(self, num_decodes: int) -> int:
        """`prefill_budget` of this scheduler's --max-prefill-tokens."""
        return prefill_budget(self.max_prefill_tokens, num_decodes)

    def flush_cache(self) -> int:
        """Evicts every cached page that no running request uses; returns how many."""
        return self.cache.flush()

    def schedule(self) -> ScheduledBatch | None:
        if self.paused:
            return None
        self.prefix.new_step()
        rows = self._schedule_decodes()
        num_decodes = len(rows)
        admitted: list[Request] = []
        decode_tokens = num_decodes + sum(c.num_drafts for _, c in rows)
        rows += self.schedule_prefills(admitted, budget=prefill_budget(self.max_prefill_tokens,
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
        snapshots = self.prefix.decode_snapshots(  # after plain rows at a page's end
            decoding, [0 if d.tokens else r.num_computed + 1 for r, d in zip(decoding, drafts)])
        rows = []
        for i, (r, draft) in enumerate(zip(decoding, drafts)):
            self.grow(r, r.num_computed + 1 + len(draft.tokens))
            rows.append((r, SeqChunk([r.output_ids[-1], *draft.tokens], r.num_computed,
                                     list(r.page_ids), True, num_drafts=len(draft.tokens),
                                     tree_parents=draft.row_parents, snapshot=snapshots.get(i))))
        return rows

    def schedule_prefills(self, admitted: list[Request], budget: int, admit: bool = True,
                           only_waiting: bool = False) -> list[tuple[Request, SeqChunk]]:
        """Chunks of unfinished prompts: running ones first (unless `only_waiting`), then new
        admissions in queue order, within `budget` prompt tokens and the free pages. Stops at the
        first request that does not fit, so a big request at the head of the queue is not
        starved by smaller ones; passes over one that `admission` holds back (its adapter's
        slot)."""
        rows = []
        running = [] if only_waiting else [r for r in self.running if not r.is_decoding]
        candidates = running + (list(self.waiting) if admit and self.admitting else [])
        for r in candidates:
            is_new = r.status == "waiting"
            if is_new:
                if len(self.running) >= self.max_running_requests:
                    break
                if not self.admission.admits(r, self.running):  # later, in its queue place
                    continue
                if not self.prefix.attach(r):  # in a later step
                    continue
                if self.prefix.waits_for_a_running_prefill(r, self.running):
                    self.prefix.detach(r)
                    continue
            remaining = r.num_tokens - r.num_computed
            n = min(remaining, budget, self.chunk_size or remaining)
            # Without chunking, a prompt over the budget runs alone, in a step of its own.
            alone = n < remaining and self.chunk_size is None
            n = remaining if alone else n
            # Not inside an image whose tokens attend to one another (Gemma 3's): cut before
            # it, or wait for a step with room for it all (start-up checked one has).
            n = r.whole_span_end(r.num_computed, r.num_computed + n)
            n = self.prefix.chunk_end(r, r.num_computed, n) - r.num_computed
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
                    r.admitted_time = time.monotonic()
            self.grow(r, r.num_computed + n)
            ids = r.all_ids()
            token_ids = ids[r.num_computed:r.num_computed + n]
            rows.append((r, SeqChunk(token_ids, r.num_computed, list(r.page_ids), n == remaining,
                                     next_token=ids[r.num_computed + n] if n < remaining else -1,
                                     **self.prefix.state_copies(r, r.slot, r.num_computed + n))))
            budget -= n
        return rows

    def schedule_continuation(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The step after `batch`, scheduled while `batch` still runs (its tokens unread), or
        None where it must wait for the results: continuation.py."""
        if self.paused:
            return None
        self.prefix.new_step()
        return schedule_continuation(self, batch)

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
        return not self.paused and bool(self.running or self.waiting)


class StepLog:
    """The scheduler's log lines, in SGLang's words (operators and their dashboards read them):
    `Prefill batch.` for every step that runs prompt tokens, and `Decode batch.` once every
    `interval` decode steps, with the generation throughput over those steps (and, with
    speculative decoding, SGLang's `accept len`: tokens a verified row kept on average)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.prefix = ""  # "[DP1] " for a data parallel replica's lines
        self._decode_steps = self._decode_tokens = 0
        self._interval_start = 0.0
        self._verified_rows = self._accepted_drafts = 0

    def verified(self, accepted_drafts: int) -> None:
        """A verified row's result: its accepted drafts are tokens of the interval too."""
        self._verified_rows += 1
        self._accepted_drafts += accepted_drafts
        self._decode_tokens += accepted_drafts

    def step(self, scheduler, kind: str, num_decodes: int,
             prefill_chunks: list[SeqChunk], cached_tokens: int) -> None:
        if prefill_chunks:
            logger.info(
                "%sPrefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: "
                "%.2f, #running-req: %d, #queue-req: %d", self.prefix, len(prefill_chunks),
                sum(len(c.token_ids) for c in prefill_chunks), cached_tokens,
                scheduler.token_usage(), num_decodes, scheduler.num_waiting)
        if kind != "decode":
            return
        # Throughput over the interval: tokens of steps 2..N over the time from step 1 to step N.
        now = time.monotonic()
        if self._decode_steps == 0:
            self._interval_start = now
        else:
            self._decode_tokens += num_decodes
        self._decode_steps += 1
        if self._decode_steps >= self.interval:
            elapsed = now - self._interval_start
            throughput = self._decode_tokens / elapsed if elapsed > 0 else 0.0
            accept = (f"accept len: {1 + self._accepted_drafts / self._verified_rows:.2f}, "
                      if self._verified_rows else "")
            logger.info(
                "%sDecode batch. #running-req: %d, #token: %d, token usage: %.2f, %s"
                "gen throughput (token/s): %.2f, #queue-req: %d", self.prefix,
                scheduler.num_running, sum(r.num_computed for r in scheduler.running),
                scheduler.token_usage(), accept, throughput, scheduler.num_waiting)
            self._decode_steps = self._decode_tokens = 0
            self._verified_rows = self._accepted_drafts = 0
