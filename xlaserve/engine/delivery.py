"""The output side of an EngineCore: what turns a step's sampled tokens (a `StepResult`) into
the `OutputChunk`s a request's sink receives (both in messages.py).

`Delivery` holds the live state of every request the engine has admitted and not yet finished
(`_Live`: its sink, its detokenizer, its prompt-logprob collector), by request id:
- `live_state` builds that state in the submitting thread (EngineCore.submit), `admit` keeps it
  and hands the request to the scheduler; one the scheduler refuses (a duplicate id) gets a
  final chunk with the error and is not kept;
- `deliver` makes each sampled token of a step a chunk: its text delta (a stop string found
  here finishes the request in the scheduler), with `return_logprob` its logprob and top
  alternatives, with the first chunk the prompt logprobs, and with the last one `meta_info`;
- `abort` ends a request early (an abort, a failed step) with a final chunk, `abort_many` many;
- an exception while making one request's chunk fails that request alone;
- a sink that raises is dropped: its request is aborted, the loop and the other requests go on.
The prompt-logprob collectors live here too: `prompt_targets` gives a prefill chunk the ids its
rows score, and `collect_prompt_logprobs` hands each collector its rows of a step.

Only the engine loop thread calls a Delivery (it shares the scheduler, which only that thread
touches), so neither needs a lock.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax
import numpy as np

from xlaserve.engine.detokenizer import IncrementalDetokenizer
from xlaserve.engine.messages import OutputChunk, SampledRow, StepResult
from xlaserve.executor.model_runner import StepOutput
from xlaserve.sampling.prompt_logprobs import PromptLogprobCollector
from xlaserve.sampling.params import SamplingParams
from xlaserve.scheduler.scheduler import Scheduler
from xlaserve.scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Live:
    """Engine-side state of one request: its sink and its detokenizer."""

    request: Request
    emit: Callable[[OutputChunk], None]
    detokenizer: IncrementalDetokenizer | None
    top_logprobs_num: int = 0  # alternatives per token in the chunks (needs return_logprob)
    prompt_logprobs: PromptLogprobCollector | None = None  # with return_prompt_logprob
    prompt_logprobs_sent: bool = False  # they go out once, with the first output chunk


def live_state(request: Request, params: SamplingParams, emit: Callable[[OutputChunk], None],
               tokenizer, top_logprobs_num: int, return_prompt_logprob: bool) -> _Live:
    """A submitted request's state for `Delivery.admit`, built in the submitting thread so that
    anything wrong with it (a stop string, say) is that caller's error, never the loop's.
    `tokenizer`: None with --skip-tokenizer-init (chunks then carry no text)."""
    detok = None
    if tokenizer is not None:
        detok = IncrementalDetokenizer(
            tokenizer, prompt_ids=request.prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop_strings=[params.stop] if isinstance(params.stop, str) else params.stop or (),
            no_stop_trim=params.no_stop_trim)
    live = _Live(request, emit, detok, top_logprobs_num)
    if return_prompt_logprob:
        live.prompt_logprobs = PromptLogprobCollector(request.prompt_ids, top_logprobs_num)
    return live


class Delivery:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._live: dict[str, _Live] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def rids(self) -> list[str]:
        """The live requests' ids (a copy: aborting them changes the set)."""
        return list(self._live)

    def admit(self, live: _Live) -> None:
        """Takes a submitted request in (its state built by `live_state` in the submitting
        thread): its live state, then the scheduler's queue."""
        request = live.request
        try:
            self.scheduler.add(request)
        except ValueError as error:  # e.g. a duplicate request id: fail this one only
            request.finish_reason = ("abort", None)
            self._emit(live, _final_chunk(request, str(error)))
        else:
            self._live[request.rid] = live

    def abort(self, rid: str, message: str | None) -> None:
        """Ends a live request in the scheduler and sends its final chunk (with `message` as its
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
            self._emit(live, _final_chunk(live.request, message, live))

    def deliver(self, step: StepResult) -> None:
        """Sends the chunk of each token a live request sampled in the step, in row order (the
        step's logprob arrays are read for a request with `return_logprob`). Whatever fails
        making one row's chunk (detokenizing, say) fails that request alone, with an error
        chunk; the other rows go on."""
        for sampled in step.rows:
            request = sampled.request
            try:
                self._deliver(sampled, step)
            except Exception as error:
                logger.exception("request %s failed while its output was made", request.rid)
                if request.rid in self._live:
                    self.abort(request.rid, f"internal error ({type(error).__name__})")

    def _deliver(self, sampled: SampledRow, step: StepResult) -> None:
        request, token = sampled.request, sampled.token
        live = self._live.get(request.rid)
        if live is None:  # dropped earlier in this step (its consumer failed)
            return
        # Whether a request is finished is the scheduler's one decision (`Scheduler._end` is the
        # only writer of an admitted request's `status` and `finish_reason`): a stop id, the
        # length or the grammar's end in `process_results`, a stop string found here (`finish`).
        finished = request.status == "finished"
        # A stop id is not part of the text; a grammar's last token (finish "stop" with no
        # matched id) is.
        stopped_by_token = finished and request.finish_reason[0] == "stop" and isinstance(
            request.finish_reason[1], int)
        delta = ""
        if live.detokenizer is not None and not stopped_by_token:
            delta = live.detokenizer.append(token)
            if live.detokenizer.matched_stop is not None and not finished:
                self.scheduler.finish(request.rid, "stop", live.detokenizer.matched_stop)
                finished = request.status == "finished"
        if finished and live.detokenizer is not None:
            delta += live.detokenizer.finish()
        logprob = top_logprobs = input_token_logprobs = input_top_logprobs = meta_info = None
        if request.sampling.return_logprob:
            row, n = sampled.row, live.top_logprobs_num
            logprob = float(step.logprobs[row])
            top_logprobs = list(zip(step.top_logprobs[row, :n].tolist(),
                                    step.top_ids[row, :n].tolist()))
        if live.prompt_logprobs is not None and not live.prompt_logprobs_sent:
            # The sampling chunk ended the prompt, so every entry is in (the step's read
            # collected it).
            input_token_logprobs, input_top_logprobs = live.prompt_logprobs.sglang_lists()
            live.prompt_logprobs_sent = True
        if finished:
            meta_info = _meta_info(request, live)
            del self._live[request.rid]
        self._emit(live, OutputChunk(
            token, delta, finished, logprob=logprob, top_logprobs=top_logprobs,
            input_token_logprobs=input_token_logprobs, input_top_logprobs=input_top_logprobs,
            meta_info=meta_info))

    def _emit(self, live: _Live, chunk: OutputChunk) -> None:
        """Hands a chunk to the request's consumer. A consumer that raises (its event loop closed,
        say) is gone: its request is aborted, and nothing it did reaches the loop or other requests."""
        try:
            live.emit(chunk)
        except Exception:
            logger.warning("dropping request %s: its output consumer failed", live.request.rid,
                           exc_info=logger.isEnabledFor(logging.DEBUG))
            if self._live.pop(live.request.rid, None) is not None:
                self.scheduler.abort(live.request.rid)

    # --- prompt logprobs ----------------------------------------------------------------------

    def _prompt_collector(self, request: Request) -> PromptLogprobCollector | None:
        """The request's prompt-logprob collector while it still has entries to fill."""
        live = self._live.get(request.rid)
        collector = live.prompt_logprobs if live is not None else None
        return None if collector is None or collector.complete else collector

    def prompt_targets(self, request: Request, chunk):
        """`chunk` (a scheduled chunk of `request`) with the target ids of its prompt rows, for a
        request that still collects prompt logprobs; otherwise `chunk` itself."""
        collector = self._prompt_collector(request)
        if collector is None:
            return chunk
        return dataclasses.replace(
            chunk, target_ids=collector.targets(chunk.num_cached, len(chunk.token_ids)))

    def collect_prompt_logprobs(self, batch, out: StepOutput) -> None:
        """Hands each prompt-logprob request its rows of the step. Nothing changed its collector
        since the step was packed (steps are read in order, and a continuation has no prompt
        rows), so it takes the rows it targeted."""
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


def _final_chunk(request: Request, error: str | None, live: _Live | None = None) -> OutputChunk:
    """The chunk that ends a request without a token (an abort, a refused request)."""
    return OutputChunk(None, "", True, meta_info=_meta_info(request, live), error=error or None)


def _meta_info(request: Request, live: _Live | None = None) -> dict:
    """A finished request's `meta_info`: its id, token counts, finish reason and, once all in,
    its prompt logprobs."""
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
