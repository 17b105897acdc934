"""The output side of an EngineCore: what turns a step's sampled tokens (a `StepResult`) into
the `OutputDelta`s a request's sink receives (both in messages.py).

`LiveRequests` holds the live state of every request the engine has admitted and not yet finished
(`LiveRequest`, messages.py: its sink, its detokenizer, its prompt-logprob collector), by id:
- `live_state` builds that state in the submitting thread (EngineCore.submit), `admit` keeps it
  and hands the request to the scheduler; one the scheduler refuses (a duplicate id) gets a
  final output with the error and is not kept;
- `deliver` makes each sampled token of a step an output: its text delta (a stop string found
  there finishes the request), with `return_logprob` its logprob and top alternatives, with the
  first output the prompt logprobs, and with the last one its `Finish`;
- `abort` ends a request early (an abort, a failed step) with a final output, `abort_many` many;
- an exception while making one request's output fails that request alone;
- a sink that raises is dropped: its request is aborted, the loop and the other requests go on.
The prompt-logprob collectors live here too: `prompt_targets` gives a prefill chunk the ids its
rows score, and `collect_prompt_logprobs` hands each collector its rows of a step.

Two threads. The engine loop calls every public method (it shares the scheduler, which only that
thread touches): `deliver` only snapshots, per row, what the scheduler decided (finished or not,
why, the output count) and queues the step. The output thread ("xlaserve-output") detokenizes,
matches stop strings, builds the outputs and calls the sinks, in queue order, so a request's
outputs keep their order and its final output (from a step or an abort) comes last. Making the
outputs of a 256-row step cost ~2.2 ms of the loop's time on a 2-core CPU; the snapshot ~0.3 ms
(benchmarks/bench_host_step.py). What the output thread decides goes back to the loop through its
inbox (`notify`, a `RequestsEnded`): a stop string (`StopMatched`: the loop ends the request in
the scheduler at the start of its next iteration, freeing its slot and pages, and only then does
the output thread send the final output) and a request the thread failed or whose sink raised
(`DropRequest`: ended without another output). Until the loop has ended it the request may sample
a token or two more: the output thread has marked it done (`LiveRequest.done`) and drops them, so
no text past a stop string ever leaves.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from typing import Callable, NamedTuple

import jax
import numpy as np

from xlaserve.runtime.engine.detokenizer import IncrementalDetokenizer
from xlaserve.runtime.engine.hidden_states import PromptRows
from xlaserve.runtime.engine.messages import (DropRequest, Finish, LiveRequest, OutputDelta,
                                              PooledResult, RequestsEnded, StepResult,
                                              StopMatched)
from xlaserve.runtime.executor.step_program import StepOutput
from xlaserve.runtime.sampling.prompt_logprobs import PromptLogprobCollector
from xlaserve.runtime.sampling.params import SamplingParams
from xlaserve.runtime.scheduler.scheduler import Scheduler
from xlaserve.runtime.scheduler.request import Request, ScheduledBatch

logger = logging.getLogger(__name__)


class RowSnapshot(NamedTuple):
    """A sampled row as the engine loop saw it when the step was read: the output thread makes
    the row's output from this, never from the request's state, which the loop goes on changing.
    One is made per row per step: a NamedTuple, ~0.15 us each (SampledRow says more)."""

    request: Request
    live: LiveRequest
    token: int
    row: int  # the row's index in the step's arrays
    num_output: int  # the output tokens up to and with this one (`completion_tokens` if it ends)
    finish: Finish | None  # how it ended, when the scheduler found this token finished it
    input_logprobs: tuple | None  # (input_token_logprobs, input_top_logprobs), on the first output
    more: bool = False  # the request's next token in the step follows (a verified row's)


def live_state(request: Request, params: SamplingParams, emit: Callable[[OutputDelta], None],
               tokenizer, top_logprobs_num: int, return_prompt_logprob: bool,
               hidden_states: PromptRows | None = None) -> LiveRequest:
    """A submitted request's state for `LiveRequests.add`, built in the submitting thread so that
    anything wrong with it (a stop string, say) is that caller's error, never the loop's.
    `tokenizer`: None with --skip-tokenizer-init (outputs then carry no text). `hidden_states`:
    its prompt's rows, where it asked for its hidden states (hidden_states.py)."""
    detok = None
    if tokenizer is not None:
        detok = IncrementalDetokenizer(
            tokenizer, prompt_ids=request.prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop_strings=[params.stop] if isinstance(params.stop, str) else params.stop or (),
            no_stop_trim=params.no_stop_trim)
    live = LiveRequest(request, emit, detok, top_logprobs_num, hidden_states=hidden_states)
    if return_prompt_logprob:
        live.prompt_logprobs = PromptLogprobCollector(request.prompt_ids, top_logprobs_num)
    return live


class LiveRequests:
    """The requests the engine has taken in and not yet finished, by id, and the output thread
    that turns their steps into outputs (module docstring)."""

    def __init__(self, scheduler: Scheduler, notify: Callable[[object], None], name: str):
        """`notify` puts a message (`RequestsEnded`) in the engine loop's inbox; `name` names
        the output thread."""
        self.scheduler = scheduler
        self._live: dict[str, LiveRequest] = {}
        # Ids of requests that may still collect prompt logprobs: every live one whose collector
        # is not complete is in it (stale ids leave at `with_prompt_targets`), so that a step where
        # none collects does no per-row work for them.
        self._collecting: set[str] = set()
        # Ids of the live requests that asked for their hidden states (stale ones leave at
        # `hidden_state_rows`): empty, a step does no per-row work for them.
        self._hidden: set[str] = set()
        self._notify = notify
        self._closing = threading.Event()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def rids(self) -> list[str]:
        """The live requests' ids (a copy: aborting them changes the set)."""
        return list(self._live)

    def close(self, timeout: float | None = None) -> None:
        """Hands out what is queued, then ends the output thread (the loop has stopped: nothing
        ends requests in the scheduler any more)."""
        self._closing.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    def add(self, live: LiveRequest) -> None:
        """Takes a submitted request in (its state built by `live_state` in the submitting
        thread): its live state, then the scheduler's queue."""
        request = live.request
        try:
            self.scheduler.add(request)
        except ValueError as error:  # e.g. a duplicate request id: fail this one only
            request.finish_reason = ("abort", None)
            self._jobs.put((live, _final_output(request, str(error))))
        else:
            self._live[request.rid] = live
            if live.prompt_logprobs is not None:
                self._collecting.add(request.rid)
            if live.hidden_states is not None:
                self._hidden.add(request.rid)

    def abort(self, rid: str, message: str | None) -> None:
        """Ends a live request in the scheduler and sends its final output (with `message` as its
        error, if any)."""
        self.abort_many([rid], message)

    def abort_many(self, rids: list[str], message: str | None) -> None:
        """`abort` for many live requests at once, in time linear in their number (a client
        that cancels thousands of queued choices must not stall the loop)."""
        rids = [rid for rid in dict.fromkeys(rids) if rid in self._live]
        self.scheduler.abort_many(rids)
        for rid in rids:
            live = self._live.pop(rid)
            live.request.finish_reason = live.request.finish_reason or ("abort", None)
            self._jobs.put((live, _final_output(live.request, message, live)))

    def end_requests(self, message: RequestsEnded) -> None:
        """What the output thread ended: a stop string it found (the request finishes "stop"),
        a request it failed or whose sink raised (aborted, with no other output from here).
        Each ends in the scheduler now, freeing its slot and pages, unless it ended meanwhile."""
        try:
            for ended in message.requests:
                if self._live.pop(ended.rid, None) is None:
                    continue
                if isinstance(ended, StopMatched):
                    self.scheduler.finish(ended.rid, "stop", ended.stop)
                else:
                    self.scheduler.abort(ended.rid)
        finally:
            message.done.set()

    def deliver(self, step: StepResult | PooledResult) -> None:
        """Queues the output of each token a live request sampled in the step, in row order, for
        the output thread; here only what the scheduler decided is read (the request's state
        changes under the output thread). A request that the step finished leaves the live set.
        An embedding step's requests get their one output, the vector."""
        if isinstance(step, PooledResult):
            for request, vector in step.rows:
                if (live := self._live.pop(request.rid, None)) is not None:
                    self._jobs.put((live, OutputDelta(None, "", True, finish=_finish(request),
                                                      embedding=vector)))
            return
        rows = []
        # A verified row's tokens (speculative decoding) are consecutive rows of one request.
        following = ([a.request is b.request for a, b in zip(step.rows, step.rows[1:])] + [False]
                     if self.scheduler.speculator.verifies else itertools.repeat(False))
        for (request, token, row, num_output), more in zip(step.rows, following):
            live = self._live.get(request.rid)
            if live is None:  # ended earlier (a stop string the output thread found, say)
                continue
            # Whether a request is finished is the scheduler's one decision (`Scheduler._end` is
            # the only writer of an admitted request's `status` and `finish_reason`): a stop id,
            # the length or the grammar's end in `process_results`; a stop string found by the
            # output thread comes back as `StopMatched`.
            # A verified row gives a request several tokens: it ends at its last one.
            finished = request.status == "finished" and num_output == len(request.output_ids)
            input_logprobs = finish = None
            if live.prompt_logprobs is not None and not live.prompt_logprobs_sent:
                # The sampling chunk ended the prompt, so every entry is in (the step's read
                # collected it).
                input_logprobs = live.prompt_logprobs.sglang_lists()
                live.prompt_logprobs_sent = True
            if finished:
                finish = _finish(request, live)
                del self._live[request.rid]
            rows.append(RowSnapshot(request, live, token, row, num_output, finish,
                                    input_logprobs, more))
        if rows:
            self._jobs.put((rows, step))

    # --- the output thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            first, second = job
            # A final output made by the loop (an abort, a refusal).
            if isinstance(first, LiveRequest):
                if not first.done:
                    first.done = True
                    self._emit(first, second)
                continue
            ended: list[StopMatched | DropRequest] = []  # for the loop to end
            finals: list = []  # (live, output): final outputs to send once the loop ended them
            for row in first:
                request, live, num_output = row.request, row.live, row.num_output
                if live.done:  # its final output went out (a stop string, a failure)
                    continue
                try:
                    self._deliver(row, second, ended, finals)
                except Exception as error:
                    logger.exception("request %s failed while its output was made", request.rid)
                    live.done = True
                    ended.append(DropRequest(request.rid))
                    finals.append((live, _final_output(
                        request, f"internal error ({type(error).__name__})", live,
                        ("abort", None), num_output)))
            if ended:
                self._end_in_loop(ended, wait=bool(finals))
            for live, output in finals:
                self._emit(live, output)

    def _end_in_loop(self, ended: list[StopMatched | DropRequest], wait: bool) -> None:
        """Has the loop end these requests in the scheduler; with `wait`, returns once it has
        (so a request's slot and pages are free before its final output goes out, as when the
        loop itself ends it), or once the loop stops."""
        message = RequestsEnded(tuple(ended), threading.Event())
        self._notify(message)
        while wait and not message.done.wait(0.05):
            if self._closing.is_set():
                return

    def _deliver(self, sampled: RowSnapshot, step: StepResult, ended: list[StopMatched | DropRequest],
                 finals: list) -> None:
        """Makes and hands out one row's output (the output thread); one that a stop string
        finishes goes to `finals`, its end in the scheduler to `ended`."""
        request, live, token, row, num_output, finish, input_logprobs, more = sampled
        # A stop id is not part of the text; a grammar's last token (finish "stop" with no
        # matched id) is.
        stopped_by_token = (finish is not None and finish.reason == "stop"
                            and isinstance(finish.matched, int))
        delta = ""
        stop_found = False
        if live.detokenizer is not None and not stopped_by_token:
            delta = live.detokenizer.append(token)
            if live.detokenizer.matched_stop is not None and finish is None:
                stop_found = True
                finish = _finish(request, live, ("stop", live.detokenizer.matched_stop), num_output)
                ended.append(StopMatched(request.rid, live.detokenizer.matched_stop))
        finished = finish is not None
        if finished and live.detokenizer is not None:
            delta += live.detokenizer.finish()
        logprob = top_logprobs = None
        if request.sampling.return_logprob:
            n = live.top_logprobs_num
            logprob = float(step.logprobs[row])
            top_logprobs = list(zip(step.top_logprobs[row, :n].tolist(),
                                    step.top_ids[row, :n].tolist()))
        input_token_logprobs, input_top_logprobs = input_logprobs or (None, None)
        live.done = finished
        # A request the scheduler ended as failed (its grammar's dead end) says why; it is
        # finished, so nothing writes its `error` any more.
        output = OutputDelta(token, delta, finished, logprob=logprob, top_logprobs=top_logprobs,
                            input_token_logprobs=input_token_logprobs,
                            input_top_logprobs=input_top_logprobs, finish=finish,
                            error=request.error if finished else None,
                            more=more and not finished and not stop_found,
                            hidden_states=None if step.hidden_states is None
                            else step.hidden_states.get(row))
        if stop_found:  # sent once the loop has ended the request
            finals.append((live, output))
        else:
            self._emit(live, output)

    def _emit(self, live: LiveRequest, output: OutputDelta) -> None:
        """Hands an output to the request's consumer (the output thread). A consumer that raises
        (its event loop closed, say) is gone: its request is dropped, and nothing it did reaches
        the loop or other requests."""
        try:
            live.emit(output)
        except Exception:
            logger.warning("dropping request %s: its output consumer failed", live.request.rid,
                           exc_info=logger.isEnabledFor(logging.DEBUG))
            if not live.done:
                live.done = True
                self._end_in_loop([DropRequest(live.request.rid)], wait=False)

    # --- prompt logprobs ----------------------------------------------------------------------

    def _prompt_collector(self, request: Request) -> PromptLogprobCollector | None:
        """The request's prompt-logprob collector while it still has entries to fill."""
        live = self._live.get(request.rid)
        collector = live.prompt_logprobs if live is not None else None
        return None if collector is None or collector.complete else collector

    def with_prompt_targets(self, batch: ScheduledBatch) -> ScheduledBatch:
        """`batch` with `prompt_targets` in each chunk; the batch itself when no live request
        collects prompt logprobs (most steps: ~0.15 ms of a 256-row step's packing saved)."""
        if self._collecting:
            self._collecting = {rid for rid in self._collecting if (live := self._live.get(rid))
                                is not None and not live.prompt_logprobs.complete}
        if not self._collecting:
            return batch
        return dataclasses.replace(batch, chunks=[
            self.prompt_targets(r, c) for r, c in zip(batch.requests, batch.chunks, strict=True)])

    def prompt_targets(self, request: Request, chunk):
        """`chunk` (a scheduled chunk of `request`) with the target ids of its prompt rows, for a
        request that still collects prompt logprobs; otherwise `output` itself."""
        collector = self._prompt_collector(request)
        if collector is None:
            return chunk
        return dataclasses.replace(
            chunk, target_ids=collector.targets(chunk.num_cached, len(chunk.token_ids)))

    def collect_prompt_logprobs(self, batch, out: StepOutput) -> None:
        """Hands each prompt-logprob request its rows of the step. Nothing changed its collector
        since the step was packed (steps are read in order, and a continuation has no prompt
        rows), so it takes the rows it targeted."""
        if not self._collecting:
            return
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


    def hidden_state_rows(self, batch: ScheduledBatch) -> list:
        """(row, PromptRows) of each running request of `batch` that asked for its hidden
        states; [] at once when no live request did (every step of most servers)."""
        if not self._hidden:
            return []
        self._hidden = {rid for rid in self._hidden if rid in self._live}
        return [(i, live.hidden_states) for i, r in enumerate(batch.requests)
                if r.status == "running" and (live := self._live.get(r.rid)) is not None
                and live.hidden_states is not None]


def _final_output(request: Request, error: str | None, live: LiveRequest | None = None,
                 reason: tuple | None = None, num_output: int | None = None) -> OutputDelta:
    """The output that ends a request without a token (an abort, a refusal, a failure)."""
    return OutputDelta(None, "", True, finish=_finish(request, live, reason, num_output),
                       error=error or None)


def _finish(request: Request, live: LiveRequest | None = None, reason: tuple | None = None,
            num_output: int | None = None) -> Finish:
    """How a finished request ended: its id, token counts, finish reason and, once all in, its
    prompt logprobs. `reason` and `num_output` (the output thread's, which must not read the
    request's changing state): default, the request's own."""
    kind, matched = reason or request.finish_reason or ("abort", None)
    completion_tokens = len(request.output_ids) if num_output is None else num_output
    collector = live.prompt_logprobs if live is not None else None
    input_token_logprobs = input_top_logprobs = None
    if collector is not None and collector.complete:  # not for one aborted mid-prompt
        input_token_logprobs, input_top_logprobs = collector.sglang_lists()
    return Finish(request.rid, kind, matched, len(request.prompt_ids), completion_tokens,
                  request.num_cached_prompt_tokens, input_token_logprobs, input_top_logprobs,
                  request.speculation.verify_ct, request.speculation.accepted_drafts,
                  0.0 if request.admitted_time is None
                  else request.admitted_time - request.arrival_time, request.weight_version)
