"""Engine: owns the model runner and the scheduler, runs the step loop in its own thread.

Requests come in through a thread-safe `submit` and leave as a stream of `OutputDelta`s; the loop
thread is the only one that touches the scheduler, the page allocator and the device state, so
none of them needs a lock. `xlaserve.Engine` (the offline API) wraps this class. The runner,
the scheduler, the features it was started with and the steps the loop stages, sends and reads
(steps.py, or pooled_outputs.PooledSteps) are built at start-up by startup.py; the outputs a
step's tokens become (text, logprobs, finish) are made by live_requests.py; what other threads
send the loop, and what it sends them, are the typed messages of messages.py.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Callable

import jax

from xlaserve.runtime.engine import startup
from xlaserve.runtime.engine.live_requests import LiveRequests, live_state
from xlaserve.runtime.engine.lora_adapters import LoraAdapters
from xlaserve.runtime.engine.messages import (Abort, AbortAll, AddRequest, FlushCache, InboxMessage,
                                              LiveRequest, OnLoop, OutputDelta, RequestsEnded,
                                              Wake, settle)
from xlaserve.runtime.engine.pooled_outputs import pooled_request
from xlaserve.runtime.engine.watchdog import Watchdog
from xlaserve.runtime.engine.weight_updates import WeightUpdates
from xlaserve.runtime.executor.step_inputs import SAMPLING_WIDTHS
from xlaserve.runtime.host import malloc_tuning
from xlaserve.runtime.sampling.params import (InvalidGrammar, RequestLimits, RowSamplingParams,
                                              SamplingParams, check_request, constraint_of,
                                              prompt_token_ids, stop_token_set)
from xlaserve.runtime.sampling.params import build_sampling_metadata
from xlaserve.runtime.scheduler.request import Request
from xlaserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests wait than --max-queued-requests: the HTTP layer answers 503 + Retry-After."""


class EngineCore:
    def __init__(self, server_args: ServerArgs, dp_rank: int = 0,
                 share_with: "EngineCore | None" = None):
        """`dp_rank`: the data parallel replica this is (runtime/engine/data_parallel.py): its model
        and KV pool live on devices [dp_rank * tp_size, (dp_rank + 1) * tp_size).
        `share_with`: another replica whose tokenizer and grammar backend this one uses."""
        self.dp_rank = dp_rank
        parts = startup.build(server_args, dp_rank, share_with)
        # --nnodes > 1: rank 0 of a multi-host group (distributed/leader.py); else OneProcess.
        self.group = parts.group
        self.args = args = parts.args  # with --page-size resolved
        self.loaded = parts.loaded
        self.tokenizer = parts.tokenizer
        self.context_length = parts.context_length
        self.runner = parts.runner
        self.buckets = parts.buckets
        self.scheduler = parts.scheduler
        self.eos_token_ids = parts.eos_token_ids
        self.grammar_backend = parts.grammar_backend
        # What it serves beyond generation: pooling, score head, images, adapters (each or None);
        # --lora-paths' adapters installed.
        self.features = startup.Features(parts.pooling, parts.classifier_head, parts.images,
                                         startup.lora_adapters(parts, self._wait),
                                         parts.hidden_states)
        self.limits = RequestLimits.from_server_args(args)
        # Seconds per start-up phase, for the server's "Start-up:" log line (launch_server.py).
        self.startup_timings = parts.startup_timings
        self._seeds = random.Random(args.random_seed)
        if self.grammar_backend is not None and share_with is None:
            self.grammar_backend.prepare_in_background()
        if jax.default_backend() == "cpu":
            malloc_tuning.keep_freed_memory()
        self._inbox: queue.Queue[InboxMessage] = queue.Queue()
        # Requests put in the inbox, and taken from it by the loop (queued_requests).
        self._submitted = self._admitted = 0
        self._submit_lock = threading.Lock()
        self._stopping = False
        name = parts.thread_name
        # The live requests' output; its output thread sends the loop what it ended.
        self._live_requests = LiveRequests(self.scheduler, self._inbox.put,
                                  name.replace("engine", "output"))
        # An RL trainer's calls: weight updates, memory released, generation paused.
        self.weights = WeightUpdates(self.runner, self.scheduler, self._live_requests,
                                     self.loaded, args, self._wait,
                                     lambda: self._inbox.put(Wake()))
        # The steps the loop stages, sends and reads, with the features' hooks (steps.py).
        self.steps = startup.step_pipeline(parts, self._live_requests, self.features.lora)
        self.weights.hooks = getattr(self.steps, "hooks", {}).get("between_steps")
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._watchdog = Watchdog(args.watchdog_timeout, self._hung,
                                  name.replace("engine", "watchdog"))
        self._thread.start()

    @property
    def failure(self) -> str | None:
        """Why the engine takes no more work (a hung step, a broken multi-host group), else None."""
        return self.group.failure

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

    def check_request(self, prompt_len: int, params: SamplingParams, top_logprobs_num: int = 0,
                      **options) -> None:
        """The one check of a request's parameters and size (`check_request`,
        runtime/sampling/params.py): raises
        InvalidSamplingParam or RequestTooLong. `submit` runs it; servers run it first, to refuse
        a call before submitting any of its copies. `options`: its `names`, `template_stop_ids`."""
        check_request(self.scheduler.check_fits, self.limits, self.loaded.config.vocab_size,
                      self.eos_token_ids, prompt_len, params, top_logprobs_num, **options)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               emit: Callable[[OutputDelta], None], rid: str | None = None,
               return_logprob: bool = False, top_logprobs_num: int = 0,
               return_prompt_logprob: bool = False, priority: int = 0,
               lora_path: str | None = None, embed: bool = False,
               second_segment: int = 0, prompt_images=None,
               return_hidden_states: bool = False) -> str:
        """Queue a request; `emit` is called from the engine's output thread (live_requests.py) with
        each OutputDelta, in order: the
        token id, its text delta, `finished`, and with `return_logprob` its logprob and
        `top_logprobs_num` (at most MAX_TOP_LOGPROBS) [(logprob, token_id)] alternatives.
        A larger `priority` is scheduled first (batch work runs below interactive requests).

        With `return_prompt_logprob`, the first output and the final `meta_info` also hold
        SGLang's `input_token_logprobs` [(logprob | None, token_id, None)] and
        `input_top_logprobs` [None | [(logprob, token_id, None)] * top_logprobs_num], one entry
        per prompt token (the first has none), under the raw model distribution. Such a request
        computes its whole prompt (no prefix reuse). `lora_path`: the name of a loaded LoRA
        adapter the request runs with (None: the base model); one not loaded raises
        UnknownAdapter.

        Everything the request will need on the engine thread (its sampling row, grammar,
        detokenizer and stop matcher, prompt-logprob collector) is built and checked here, in the
        caller's thread: a request the engine cannot serve raises ValueError (InvalidSamplingParam
        naming the field, RequestTooLong, from `check_request`; InvalidGrammar) or QueueFull,
        and never reaches the loop.

        `embed`: an embedding request, on an embedding server (`pooling`): its one output is
        final and carries the prompt's embedding; `params` and the options are not read;
        `second_segment`: a cross-encoder pair's document starts there (token type 1).
        `prompt_images`: a vision model's prompt with images (`images.prepare`: `prompt_ids` as it
        expanded them, and its PromptImages). `return_hidden_states`: each output also carries
        its token's entry of SGLang's hidden states (runtime/engine/hidden_states.py); such a
        request computes its whole prompt; a server without --enable-return-hidden-states
        refuses it (HiddenStatesRefused, a ValueError)."""
        prompt_ids = prompt_token_ids(prompt_ids, self.loaded.config.vocab_size)
        self.steps.check_kind(embed, prompt_images, len(prompt_ids))
        if embed:
            return self._submit_embedding(prompt_ids, emit, rid, priority, second_segment)
        self.check_request(len(prompt_ids), params, top_logprobs_num)
        prompt_rows = self.features.hidden_states.rows_for(len(prompt_ids), params.max_new_tokens,
                                                           return_hidden_states)
        self._check_room()
        rid = rid or uuid.uuid4().hex
        self.compile_grammar(params)  # a cache hit where the server compiled it already
        stop_ids = stop_token_set(params, self.eos_token_ids)  # checked: only the set here
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        sampling = RowSamplingParams.from_params(
            params, seed, return_logprob=bool(return_logprob or top_logprobs_num > 0))
        # The row as the step will pack it, so a value its columns cannot hold fails here.
        build_sampling_metadata([sampling], 1, SAMPLING_WIDTHS)
        grammar = None
        if (constraint := constraint_of(params)) is not None:
            grammar = self.grammar_backend.new_grammar(*constraint, stop_token_ids=stop_ids)
        request = Request(rid=rid, prompt_ids=prompt_ids, max_new_tokens=params.max_new_tokens,
                          sampling=sampling, stop_token_ids=frozenset(stop_ids),
                          min_new_tokens=params.min_new_tokens, priority=priority,
                          no_prefix_reuse=return_prompt_logprob or prompt_rows is not None,
                          grammar=grammar, prompt_images=prompt_images,
                          weight_version=self.weights.version)
        live = live_state(request, params, emit, self.tokenizer, top_logprobs_num,
                          return_prompt_logprob, prompt_rows)
        if lora_path is None:
            self._put_request(live)
        else:  # resolved and queued ahead of any unload of it (lora_adapters.py)
            LoraAdapters.submit(self.features.lora, lora_path, request,
                                lambda: self._put_request(live))
        return rid

    def _submit_embedding(self, prompt_ids: list[int], emit, rid: str | None, priority: int,
                          second_segment: int) -> str:
        """`submit` of an embedding request: CLS and mean pooling read every row, so no cached
        prefix (pooled_outputs.py). Its kind was checked in `submit`."""
        self.scheduler.check_fits(len(prompt_ids), 0, pooled=True)
        self._check_room()
        rid = rid or uuid.uuid4().hex
        request = pooled_request(rid, prompt_ids, self.features.pooling, priority, second_segment)
        self._put_request(LiveRequest(request, emit, None))
        return rid

    def _check_room(self) -> None:
        """RuntimeError once the engine takes no more work, QueueFull while its queue is full."""
        if not self.is_alive():
            raise RuntimeError(self.stopped_reason())
        queued = self.queued_requests()
        if queued >= self.limits.max_queued_requests:
            raise QueueFull(f"the server's queue is full ({queued} requests wait, "
                            f"--max-queued-requests {self.limits.max_queued_requests}): retry later")

    def check_embedding_input(self, prompt_len: int) -> None:
        """An embedding input's size: RequestTooLong over the context length (or the KV pool),
        ValueError for an empty one or on a server that generates."""
        self.steps.check_kind(True)
        self.scheduler.check_fits(prompt_len, 0, pooled=True)

    def _put_request(self, live) -> None:
        with self._submit_lock:
            self._submitted += 1
        self._inbox.put(AddRequest(live))

    def load_lora_adapter(self, name: str, path: str):
        """Serves the PEFT adapter at `path` as `name` (lora_adapters.py, `LoraAdapters.load`)."""
        return LoraAdapters.serving(self.features.lora).load(name, path)

    def unload_lora_adapter(self, name: str):
        """Stops serving `name` once its requests have ended (`LoraAdapters.unload`)."""
        return LoraAdapters.serving(self.features.lora).unload(name)

    def queued_requests(self) -> int:
        """Requests submitted that wait for a running slot: those in the scheduler's queue and
        those not yet taken from the inbox, less the free slots (read from other threads: an
        estimate, which is all a bound on the queue needs)."""
        pending = self._submitted - self._admitted
        free = self.args.max_running_requests - self.scheduler.num_running
        return max(0, pending + self.scheduler.num_waiting - free)

    @property
    def max_request_tokens(self) -> int:
        """The longest prompt + output one request may have: the context length, or what the
        whole KV pool holds if that is less (the last sampled token needs no KV)."""
        return self.scheduler.max_request_tokens

    @property
    def max_total_num_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.scheduler.allocator.capacity * self.args.page_size

    def stats(self) -> dict:
        """Scheduler figures for /metrics and /get_server_info (read from another thread: each
        is one attribute read, and a stale value is harmless there)."""
        stats = {"num_running_reqs": self.scheduler.num_running,
                 "num_queue_reqs": self.scheduler.num_waiting,
                 "token_usage": self.scheduler.token_usage()}
        return stats | self.scheduler.speculator.stats()

    def abort(self, rid: str, message: str | None = None) -> None:
        """Ends the request (waiting or running) on the engine thread; its final output carries
        `message` as its error, if given."""
        self._inbox.put(Abort(rid, message))

    def abort_all(self, message: str) -> None:
        """Ends every request the engine holds, each with a final output whose error is `message`
        (the server's graceful shutdown ran out of time)."""
        self._inbox.put(AbortAll(message))

    def flush_cache(self) -> int:
        """Empties the prefix cache of the pages no running request uses, on the engine thread
        between steps; returns how many pages it freed, once done."""
        return self._wait(FlushCache(Future()))

    def _wait(self, message):
        """Puts `message` in the inbox and waits for its `done` future."""
        self._inbox.put(message)
        while True:
            try:
                return message.done.result(timeout=1.0)
            except TimeoutError:
                if not self.is_alive():
                    raise RuntimeError(self.stopped_reason()) from None

    def shutdown(self) -> None:
        self._stopping = True
        self._watchdog.stop()
        self._inbox.put(Wake())
        self._thread.join(timeout=30)
        self._live_requests.close(timeout=30)
        self.group.close()  # the followers stop too

    # --- the engine thread ------------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    def stopped_reason(self) -> str:
        """Why the engine takes no work (when `is_alive()` is false), for errors and /health."""
        return self.failure or "the engine loop is not running (shut down, or it failed; see the log)"

    def _hung(self, reason: str) -> None:
        """The watchdog's verdict: no more work; in a multi-host group the followers go too."""
        self.group.fail(reason)

    def _loop(self) -> None:
        """One step per iteration, overlapped with the host work around it (the default; SGLang's
        overlap scheduler). JAX dispatches a step asynchronously, so:

        - while step k computes, the host schedules and dispatches step k+1, when it is a
          continuation (every request of k decodes the token k samples, read from the device,
          and waiting requests are admitted beside them: `Scheduler.schedule_continuation`);
          the device goes from one step to the next without waiting for the host to read
          tokens, pack a batch and dispatch it;
        - otherwise (a prompt chunk that samples nothing, retraction) step k is read first and
          k+1 scheduled from its results;
        - either way, the host work on k's results that no step needs (detokenizing, stop
          strings, handing outputs out) is not the loop's: `LiveRequests.deliver` queues it for the
          output thread (live_requests.py), and a stop string that thread finds comes back through
          the inbox (the request ends at the next iteration's start).
        - a continuation with a constrained row (structured outputs) needs k's tokens for its
          grammar masks: it is scheduled and staged while k computes, and sent once k is read
          and the masks are filled (~5 us a row), so only that much host time stands between
          the two steps.

        A request that ends in step k (a stop id or string, an abort) may still have a row in
        k+1; that row's result is dropped."""
        in_flight = None  # (batch, step output) dispatched and not yet read
        steps = self.steps
        overlap = not self.args.disable_overlap_schedule and steps.overlaps
        while not self._stopping:
            self._watchdog.last_beat = time.monotonic()
            stepping: list = []  # the batches this iteration touched: a failure fails their rows
            sent = self.group.sent
            try:
                self._drain_inbox(block=in_flight is None and not self.scheduler.has_work())
                if self._stopping:
                    break
                if in_flight is not None:
                    stepping.append(in_flight[0])
                following = waiting_for_masks = None
                if in_flight is not None and overlap:
                    batch = self.scheduler.schedule_continuation(in_flight[0])
                    if batch is not None:
                        stepping.append(batch)
                        staged = steps.stage(batch)
                        if batch.any_grammar():
                            waiting_for_masks = (batch, staged)
                        else:
                            following = (batch, steps.send(batch, staged))
                results = [steps.read(*in_flight)] if in_flight is not None else []
                if waiting_for_masks is not None:  # the grammars have consumed k's tokens
                    following = (waiting_for_masks[0], steps.send(*waiting_for_masks))
                in_flight = following
                if in_flight is None and (batch := self.scheduler.schedule()) is not None:
                    stepping.append(batch)
                    in_flight = (batch, steps.send(batch, steps.stage(batch)))
                    if not overlap:
                        results.append(steps.read(*in_flight))
                        in_flight = None
                stepping = []  # the steps ran: what fails from here is one request's own
                for step in results:
                    self._live_requests.deliver(step)
            except Exception as error:  # a bug must not kill the loop silently
                in_flight = None
                self._step_failed(error, stepping, broadcast=self.group.sent != sent)

    def _step_failed(self, error: Exception, batches: list, broadcast: bool) -> None:
        """A step failed: its rows (the requests of `batches`) end with an error; requests that
        were not in it go on. A failure outside any step (the scheduler itself) fails every live
        request, its state being unknown. In a multi-host group, a failure after the leader sent
        the followers something breaks the group (they may have made a call the leader did not);
        one before (a request's host-side packing, say) does not."""
        if batches:
            rids = list(dict.fromkeys(r.rid for batch in batches for r in batch.requests
                                      if r.rid in self._live_requests))
            logger.exception("engine step failed; aborting its %d requests", len(rids))
        else:
            rids = self._live_requests.rids()
            logger.exception("engine loop failed outside a step; aborting every live request")
        if broadcast:
            self.group.step_failed(error)
        self._live_requests.abort_many(rids, self.failure or f"internal error ({type(error).__name__})")

    def _drain_inbox(self, block: bool) -> None:
        """Takes in what other threads sent, in order; consecutive aborts are done together
        (`LiveRequests.abort_many`: linear in their number, however long the queue)."""
        self.steps.between_steps()  # the features' (an unload whose requests have ended)
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        aborts: list[str] = []  # consecutive aborts with one message
        message = None
        while item is not None:
            if aborts and (not isinstance(item, Abort) or item.message != message):
                self._live_requests.abort_many(aborts, message)
                aborts = []
            match item:  # a Wake (shutdown's) only ends the wait: the loop sees _stopping
                case Abort():
                    aborts.append(item.rid)
                    message = item.message
                case AddRequest():
                    self._admitted += 1
                    self._live_requests.add(item.live)
                case RequestsEnded():
                    self._live_requests.end_requests(item)
                case AbortAll():
                    self._live_requests.abort_many(self._live_requests.rids(), item.message)
                case FlushCache():
                    settle(item.done, self.scheduler.flush_cache)
                case OnLoop():
                    item.run()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        if aborts:
            self._live_requests.abort_many(aborts, message)
