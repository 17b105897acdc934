"""Engine: owns the model runner and the scheduler, runs the step loop in its own thread.

Requests come in through a thread-safe `submit` and leave as a stream of output chunks; the loop
thread is the only one that touches the scheduler, the page allocator and the device state, so
none of them needs a lock. `xlaserve.Engine` (the offline API) wraps this class. The runner,
the scheduler and the rest the engine serves with are built at start-up by engine_startup.py.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import uuid
from concurrent.futures import Future
from typing import Callable

import jax
import numpy as np

from xlaserve.runtime import engine_startup, malloc_tuning
from xlaserve.runtime.batch import pack
from xlaserve.runtime.detokenizer import IncrementalDetokenizer
from xlaserve.runtime.distributed import lead
from xlaserve.runtime.grammar import InvalidGrammar, constraint_of
from xlaserve.runtime.model_runner import (MAX_SUPPRESSED_IDS, MAX_TOP_LOGPROBS,
                                           SAMPLING_WIDTHS, ModelRunner, StepOutput)
from xlaserve.runtime.prompt_logprobs import PromptLogprobCollector
from xlaserve.runtime.sampler import RowSamplingParams, build_sampling_metadata
from xlaserve.runtime.sampling_params import SamplingParams
from xlaserve.runtime.scheduler import Request
from xlaserve.runtime.watchdog import Watchdog
from xlaserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Live:
    """Engine-side state of one request: its sink and its detokenizer."""

    request: Request
    emit: Callable[[dict], None]
    detokenizer: IncrementalDetokenizer | None
    top_logprobs_num: int = 0  # alternatives per token in the chunks (needs return_logprob)
    prompt_logprobs: PromptLogprobCollector | None = None  # with return_prompt_logprob
    prompt_logprobs_sent: bool = False  # they go out once, with the first output chunk


class EngineCore:
    def __init__(self, server_args: ServerArgs, dp_rank: int = 0,
                 share_with: "EngineCore | None" = None):
        """`dp_rank`: the data parallel replica this is (runtime/data_parallel.py): its model
        and KV pool live on devices [dp_rank * tp_size, (dp_rank + 1) * tp_size).
        `share_with`: another replica whose tokenizer and grammar backend this one uses."""
        self.dp_rank = dp_rank
        self.failure: str | None = None  # why a multi-host group broke: the engine takes no work
        self._leader = None
        parts = engine_startup.build(server_args, dp_rank, share_with,
                                     on_runner=self._lead if server_args.nnodes > 1 else None)
        self.args = args = parts.args  # with --page-size resolved
        self.loaded = parts.loaded
        self.tokenizer = parts.tokenizer
        self.context_length = parts.context_length
        self.runner = parts.runner
        self.buckets = parts.buckets
        self.scheduler = parts.scheduler
        self.eos_token_ids = parts.eos_token_ids
        self.grammar_backend = parts.grammar_backend
        # Seconds per start-up phase, for the server's "Start-up:" log line (launch_server.py).
        self.startup_timings = parts.startup_timings
        self._seeds = random.Random(args.random_seed)
        if self.grammar_backend is not None and share_with is None:
            # The token table (~0.3 s), before a request waits on it.
            threading.Thread(target=self.grammar_backend.prepare, name="xlaserve-grammar",
                             daemon=True).start()
        if jax.default_backend() == "cpu":
            malloc_tuning.keep_freed_memory()
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._stopping = False
        name = "xlaserve-engine" + (f"-dp{dp_rank}" if args.dp_size > 1 else "")
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._watchdog = Watchdog(args.watchdog_timeout, self._hung,
                                  name.replace("engine", "watchdog"))
        self._thread.start()

    def _lead(self, args: ServerArgs, runner: ModelRunner) -> None:
        """--nnodes > 1: the followers replay this runner's device calls (runtime/distributed.py).
        `build` calls this between the runner and the precompile, which then runs on the
        followers too. `lead` takes the core itself, not the parts: it reads `args` and `runner`
        off it now and sets its `failure` when the group breaks, so those two are set first."""
        self.args, self.runner = args, runner
        self._leader = lead(self)

    # --- called from any thread -----------------------------------------------------------

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles the constraint of `params` (json_schema, regex or ebnf) into the backend's
        cache; raises InvalidGrammar (naming the field) for one that cannot be used. The first
        call builds the token table (~0.3 s at 49K tokens) and a big schema can take longer, so
        servers call it off their event loop before `submit`, which then hits the cache."""
        constraint = constraint_of(params)
        if constraint is None:
            return
        kind, text = constraint
        if self.grammar_backend is None:
            why = ("--grammar-backend none" if self.args.grammar_backend == "none"
                   else "--skip-tokenizer-init (the grammar needs the tokenizer)")
            raise InvalidGrammar(kind, f"{kind} needs constrained decoding, which is off: {why}")
        self.grammar_backend.compile(kind, text)

    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[dict], None],
               rid: str | None = None, return_logprob: bool = False,
               top_logprobs_num: int = 0, return_prompt_logprob: bool = False,
               priority: int = 0) -> str:
        """Queue a request; `emit` is called from the engine thread with each output chunk: the
        token id, its text delta, `finished`, and with `return_logprob` its logprob and
        `top_logprobs_num` (at most MAX_TOP_LOGPROBS) [(logprob, token_id)] alternatives.
        A larger `priority` is scheduled first (batch work runs below interactive requests).

        With `return_prompt_logprob`, the first output chunk and the final `meta_info` also hold
        SGLang's `input_token_logprobs` [(logprob | None, token_id, None)] and
        `input_top_logprobs` [None | [(logprob, token_id, None)] * top_logprobs_num], one entry
        per prompt token (the first has none), under the raw model distribution. Such a request
        computes its whole prompt (no prefix reuse)."""
        if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
        if not self.is_alive():
            raise RuntimeError(self.stopped_reason())
        params.validate(self.loaded.config.vocab_size)
        self.compile_grammar(params)  # a cache hit where the server compiled it already
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        rid = rid or uuid.uuid4().hex
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        if len(stop_ids) > MAX_SUPPRESSED_IDS:  # min_new_tokens masks all of them in one table row
            raise ValueError(f"stop_token_ids plus the model's EOS ids come to {len(stop_ids)}; "
                             f"at most {MAX_SUPPRESSED_IDS} are supported")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        sampling = RowSamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            min_p=params.min_p, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias={int(k): float(v) for k, v in params.logit_bias.items()}, seed=seed,
            return_logprob=return_logprob or top_logprobs_num > 0)
        grammar = None
        if (constraint := constraint_of(params)) is not None:
            grammar = self.grammar_backend.new_grammar(*constraint, stop_token_ids=stop_ids)
        request = Request(rid=rid, prompt_ids=list(prompt_ids), max_new_tokens=params.max_new_tokens,
                          sampling=sampling, stop_token_ids=frozenset(stop_ids),
                          min_new_tokens=params.min_new_tokens, priority=priority,
                          no_prefix_reuse=return_prompt_logprob, grammar=grammar)
        self.scheduler.check_fits(request)  # raises ValueError before anything is queued
        self._inbox.put(("add", request, params, (emit, top_logprobs_num, return_prompt_logprob)))
        return rid

    @property
    def max_request_tokens(self) -> int:
        """The longest prompt + output one request may have: the context length, or what the
        whole KV pool holds if that is less (the last sampled token needs no KV)."""
        pool_tokens = self.scheduler.allocator.capacity * self.args.page_size + 1
        return min(self.context_length, pool_tokens)

    @property
    def max_total_num_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.scheduler.allocator.capacity * self.args.page_size

    def stats(self) -> dict:
        """Scheduler figures for /metrics and /get_server_info (read from another thread: each
        is one attribute read, and a stale value is harmless there)."""
        return {"num_running_reqs": self.scheduler.num_running,
                "num_queue_reqs": self.scheduler.num_waiting,
                "token_usage": self.scheduler.token_usage()}

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid, None, None))

    def flush_cache(self) -> int:
        """Empties the prefix cache of the pages no running request uses, on the engine thread
        between steps; returns how many pages it freed, once done."""
        done: Future = Future()
        self._inbox.put(("flush", done, None, None))
        while True:
            try:
                return done.result(timeout=1.0)
            except TimeoutError:
                if not self.is_alive():
                    raise RuntimeError(self.stopped_reason()) from None

    def shutdown(self) -> None:
        self._stopping = True
        self._watchdog.stop()
        self._inbox.put(("wake", None, None, None))
        self._thread.join(timeout=30)
        if self._leader is not None:  # the followers stop too
            self._leader.close()

    # --- the engine thread ------------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    def stopped_reason(self) -> str:
        """Why the engine takes no work (when `is_alive()` is false), for errors and /health."""
        return self.failure or "the engine loop is not running (shut down, or it failed; see the log)"

    def _hung(self, reason: str) -> None:
        """The watchdog's verdict: no more work; in a multi-host group the followers go too."""
        if self._leader is not None:
            self._leader.fail(reason)
        else:
            self.failure = reason

    def _loop(self) -> None:
        """One step per iteration, overlapped with the host work around it (the default; SGLang's
        overlap scheduler). JAX dispatches a step asynchronously, so:

        - while step k computes, the host schedules and dispatches step k+1, when it is a plain
          continuation (every request of k decodes the token k samples, read from the device:
          `Scheduler.schedule_continuation`); the device goes from one step to the next without
          waiting for the host to read tokens, pack a batch and dispatch it;
        - otherwise (admissions, prompt chunks, retraction) step k is read first and k+1 scheduled
          from its results;
        - either way, the host work on k's results that no step needs (detokenizing, stop
          strings, handing chunks out) runs while k+1 computes.
        - a continuation with a constrained row (structured outputs) needs k's tokens for its
          grammar masks: it is scheduled and packed while k computes, and sent once k is read
          and the masks are filled (~5 us a row), so only that much host time stands between
          the two steps.

        A request that ends in step k (a stop id or string, an abort) may still have a row in
        k+1; that row's result is dropped."""
        in_flight = None  # (batch, step output) dispatched and not yet read
        overlap = not self.args.disable_overlap_schedule
        while not self._stopping:
            self._watchdog.beat()
            try:
                self._drain_inbox(block=in_flight is None and not self.scheduler.has_work())
                if self._stopping:
                    break
                following = waiting_for_masks = None
                if in_flight is not None and overlap:
                    batch = self.scheduler.schedule_continuation(in_flight[0])
                    if batch is not None:
                        prepared = self._prepare(batch)
                        if any(r.grammar is not None for r in batch.requests):
                            waiting_for_masks = (batch, prepared)
                        else:
                            following = (batch, self._send(batch, prepared))
                results = self._read(*in_flight) if in_flight is not None else None
                if waiting_for_masks is not None:  # the grammars have consumed k's tokens
                    following = (waiting_for_masks[0], self._send(*waiting_for_masks))
                in_flight = following
                if in_flight is None and (batch := self.scheduler.schedule()) is not None:
                    in_flight = (batch, self._dispatch(batch))
                    if not overlap:
                        results = (results or []) + self._read(*in_flight)
                        in_flight = None
                for delivery in results or ():
                    self._deliver(*delivery)
            except Exception as error:  # a bug must not kill the loop silently: fail what is in flight
                logger.exception("engine step failed; aborting the running requests")
                if self._leader is not None:  # the followers may have diverged: the group breaks
                    self._leader.step_failed(error)
                in_flight = None
                for rid in list(self._live):
                    self.scheduler.abort(rid)
                    self._finish_aborted(rid, self.failure or "internal error")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload, params, extra = item
            if kind == "add":
                emit, top_logprobs_num, return_prompt_logprob = extra
                detok = None
                if self.tokenizer is not None:
                    detok = IncrementalDetokenizer(
                        self.tokenizer, prompt_ids=payload.prompt_ids,
                        skip_special_tokens=params.skip_special_tokens,
                        stop_strings=[params.stop] if isinstance(params.stop, str) else params.stop or (),
                        no_stop_trim=params.no_stop_trim)
                live = _Live(payload, emit, detok, top_logprobs_num)
                if return_prompt_logprob:
                    live.prompt_logprobs = PromptLogprobCollector(payload.prompt_ids, top_logprobs_num)
                try:
                    self.scheduler.add(payload)
                except ValueError as error:  # e.g. a duplicate request id: fail this one only
                    payload.finish_reason = ("abort", None)
                    self._emit(live, self._final_chunk(payload, str(error)))
                else:
                    self._live[payload.rid] = live
            elif kind == "abort" and payload in self._live:
                self.scheduler.abort(payload)
                self._finish_aborted(payload, None)
            elif kind == "flush":
                try:
                    payload.set_result(self.scheduler.flush_cache())
                except Exception as error:  # the caller waits on the future: hand it the error
                    payload.set_exception(error)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, batch):
        """Sends the step to the device; returns its (asynchronous) output."""
        return self._send(batch, self._prepare(batch))

    def _prepare(self, batch):
        """The step's inputs, packed and sent: all but the grammar masks."""
        for request in batch.admitted:
            self.runner.assign_slot(request.slot, request.prompt_ids, request.output_ids)
        chunks = [self._with_prompt_targets(r, c)
                  for r, c in zip(batch.requests, batch.chunks, strict=True)]
        fb = pack(chunks, self.buckets, self.runner.page_size)
        padded_seqs = fb.shape[1]
        # Most rows suppress nothing: a copy of their parameters per step would cost more host
        # time than the rest of the packing (a few ms at 128 rows).
        rows = [dataclasses.replace(r.sampling, suppressed_ids=suppressed)
                if (suppressed := self.scheduler.suppressed_ids(r, batch.ahead)) else r.sampling
                for r in batch.requests]
        sampling = build_sampling_metadata(rows, padded_seqs, SAMPLING_WIDTHS)
        sampling.sample_index[:len(rows)] = [len(r.output_ids) + batch.ahead for r in batch.requests]
        slots = np.zeros(padded_seqs, np.int32)
        slots[:len(batch.slots)] = batch.slots
        return self.runner.pack(fb, sampling, slots)

    def _send(self, batch, packed):
        """Fills the grammar masks of the constrained rows that sample, from their grammars'
        current state, and dispatches the step; returns its (asynchronous) output."""
        constrained = [(r.grammar, i) for i, (r, c) in enumerate(zip(batch.requests, batch.chunks))
                       if r.grammar is not None and c.sample and r.status == "running"]
        bitmask = None
        if constrained:
            bitmask = self.grammar_backend.empty_bitmask(packed.shape[1])
            self.grammar_backend.fill_masks(constrained, bitmask)
        return self.runner.run(packed, bitmask)

    def _prompt_collector(self, request: Request) -> PromptLogprobCollector | None:
        """The request's prompt-logprob collector while it still has entries to fill."""
        live = self._live.get(request.rid)
        collector = live.prompt_logprobs if live is not None else None
        return None if collector is None or collector.complete else collector

    def _with_prompt_targets(self, request: Request, chunk):
        collector = self._prompt_collector(request)
        if collector is None:
            return chunk
        return dataclasses.replace(
            chunk, target_ids=collector.targets(chunk.num_cached, len(chunk.token_ids)))

    def _collect_prompt_logprobs(self, batch, out: StepOutput) -> None:
        """Hands each prompt-logprob request its rows of the step. Nothing changed its collector
        since `_dispatch` (steps are read in order, and a continuation has no prompt rows), so it
        takes the rows it targeted."""
        collecting = [(i, c) for i, r in enumerate(batch.requests)
                      if r.status == "running" and (c := self._prompt_collector(r)) is not None]
        if not collecting:
            return  # an ordinary step: its prompt outputs are zeros, not worth the transfer
        logprobs, top_ids, top_logprobs = jax.device_get(
            (out.prompt.logprobs, out.prompt.top_ids, out.prompt.top_logprobs))
        starts = np.cumsum([0] + [len(c.token_ids) for c in batch.chunks])
        for i, collector in collecting:
            rows = slice(starts[i], starts[i + 1])
            collector.collect(batch.chunks[i].num_cached, logprobs[rows], top_ids[rows],
                              top_logprobs[rows])

    def _read(self, batch, out: StepOutput) -> list[tuple]:
        """Waits for the step's tokens and advances the scheduler; returns the deliveries
        (`_deliver` arguments) of the rows that sampled."""
        num_rows = len(batch.requests)
        sampled = out.sample
        tokens = np.asarray(sampled.tokens)[:num_rows]
        logprobs = top = None
        if any(r.sampling.return_logprob for r in batch.requests):
            logprobs = np.asarray(sampled.logprobs)[:num_rows]
            top = (np.asarray(sampled.top_logprobs)[:num_rows], np.asarray(sampled.top_ids)[:num_rows])
        self._collect_prompt_logprobs(batch, out)
        # Requests that ended while the step ran (abort, stop string) have no row to advance.
        live_before = {r.rid for r in batch.requests if r.status == "running"}
        finished = {r.rid for r in self.scheduler.process_results(batch, tokens.tolist())}
        return [(request, int(tokens[i]), request.rid in finished, logprobs, top, i)
                for i, (request, chunk) in enumerate(zip(batch.requests, batch.chunks, strict=True))
                if chunk.sample and request.rid in live_before]

    def _deliver(self, request: Request, token: int, finished: bool, logprobs, top, row) -> None:
        live = self._live.get(request.rid)
        if live is None:  # dropped earlier in this step (its consumer failed)
            return
        # A stop id is not part of the text; a grammar's last token (finish "stop" with no
        # matched id) is.
        stopped_by_token = finished and request.finish_reason[0] == "stop" and isinstance(
            request.finish_reason[1], int)
        delta = ""
        if live.detokenizer is not None and not stopped_by_token:
            delta = live.detokenizer.append(token)
            if live.detokenizer.matched_stop is not None and not finished:
                self.scheduler.finish(request.rid, "stop", live.detokenizer.matched_stop)
                finished = True
        if finished and live.detokenizer is not None:
            delta += live.detokenizer.finish()
        chunk = {"token_id": token, "logprob": None, "text": delta, "finished": finished}
        if request.sampling.return_logprob:
            chunk["logprob"] = float(logprobs[row])
            n = live.top_logprobs_num
            chunk["top_logprobs"] = list(zip(top[0][row, :n].tolist(), top[1][row, :n].tolist()))
        if live.prompt_logprobs is not None and not live.prompt_logprobs_sent:
            # The sampling chunk ended the prompt, so every entry is in (`_read` collected it).
            chunk["input_token_logprobs"], chunk["input_top_logprobs"] = \
                live.prompt_logprobs.sglang_lists()
            live.prompt_logprobs_sent = True
        if finished:
            chunk["meta_info"] = self._meta_info(request, live)
            del self._live[request.rid]
        self._emit(live, chunk)

    def _emit(self, live: _Live, chunk: dict) -> None:
        """Hands a chunk to the request's consumer. A consumer that raises (its event loop closed,
        say) is gone: its request is aborted, and nothing it did reaches the loop or other requests."""
        try:
            live.emit(chunk)
        except Exception:
            logger.warning("dropping request %s: its output consumer failed", live.request.rid,
                           exc_info=logger.isEnabledFor(logging.DEBUG))
            if self._live.pop(live.request.rid, None) is not None:
                self.scheduler.abort(live.request.rid)

    def _finish_aborted(self, rid: str, message: str | None) -> None:
        live = self._live.pop(rid)
        live.request.finish_reason = live.request.finish_reason or ("abort", None)
        self._emit(live, self._final_chunk(live.request, message, live))

    def _final_chunk(self, request: Request, error: str | None, live: _Live | None = None) -> dict:
        chunk = {"token_id": None, "logprob": None, "text": "", "finished": True,
                 "meta_info": self._meta_info(request, live)}
        if error:
            chunk["error"] = error
        return chunk

    def _meta_info(self, request: Request, live: _Live | None = None) -> dict:
        kind, matched = request.finish_reason or ("abort", None)
        finish_reason = {"type": kind}
        if kind == "length":
            finish_reason["length"] = len(request.output_ids)
        elif kind == "stop":
            finish_reason["matched"] = matched
        info = {"id": request.rid, "prompt_tokens": len(request.prompt_ids),
                "completion_tokens": len(request.output_ids),
                "cached_tokens": request.num_cached_prompt_tokens,
                "finish_reason": finish_reason}
        collector = live.prompt_logprobs if live is not None else None
        if collector is not None and collector.complete:  # not for one aborted mid-prompt
            info["input_token_logprobs"], info["input_top_logprobs"] = collector.sglang_lists()
        return info

