"""Requests submitted together from an asyncio event loop, read back as one stream of outputs.

The engine thread calls each request's `emit` with OutputChunks; here they cross into the event
loop (`call_soon_threadsafe`) and come out of one queue tagged with the caller's index, so `n`
choices or several prompts of one HTTP request are read by a single consumer in arrival order.
Submission is synchronous, so a request the engine refuses raises before anything is streamed.
A streamed choice's outputs go out in events of `--stream-interval` tokens (`StreamBuffer`).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

from xlaserve.runtime.engine.core import EngineCore
from xlaserve.runtime.engine.messages import Finish, OutputDelta
from xlaserve.runtime.sampling.params import SamplingParams

LIVENESS_POLL_S = 1.0  # how often a waiting reader checks that the engine loop still runs


class EngineDeadError(RuntimeError):
    pass


class AsyncRequestGroup:
    def __init__(self, core: EngineCore):
        self.core = core
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished: dict[int, str] = {}  # index -> rid

    def submit(self, index: int, prompt_ids: list[int], params: SamplingParams, **options) -> str:
        """Queues one request (`options` go to `EngineCore.submit`); raises ValueError if the
        engine refuses it. On a refusal the caller should `abort()` the ones already queued."""
        put = self._queue.put_nowait
        loop = self._loop

        def emit(output: OutputDelta) -> None:
            loop.call_soon_threadsafe(put, (index, output))

        rid = self.core.submit(prompt_ids, params, emit, **options)
        self._unfinished[index] = rid
        return rid

    async def outputs(self) -> AsyncIterator[tuple[int, OutputDelta]]:
        """(index, output) pairs until every request has sent its final output.

        Not `asyncio.wait_for(queue.get(), ...)`: on Python 3.10-3.11 it returns the item instead
        of raising when the reader is cancelled as an output arrives, so a cancelled reader (a
        cancelled background response, a client gone) ran on with its requests aborted and
        unfinished (CI saw a cancelled response stay `in_progress`). `asyncio.wait` never
        swallows the caller's cancellation; one getter lives across the liveness polls."""
        getter = None
        try:
            while self._unfinished:
                if not self._queue.empty():
                    index, output = self._queue.get_nowait()
                else:
                    getter = getter or asyncio.ensure_future(self._queue.get())
                    done, _ = await asyncio.wait((getter,), timeout=LIVENESS_POLL_S)
                    if not done:
                        if not self.core.is_alive():
                            raise EngineDeadError(self.core.stopped_reason())
                        continue
                    (index, output), getter = getter.result(), None
                if output.finished:
                    self._unfinished.pop(index, None)
                yield index, output
        finally:
            if getter is not None:
                getter.cancel()

    def abort(self, message: str | None = None) -> None:
        """Aborts every request that has not finished (the consumer went away, or failed); with
        `message`, their final outputs carry it as an error."""
        for rid in self._unfinished.values():
            self.core.abort(rid, message)
        self._unfinished.clear()


@dataclasses.dataclass
class Choice:
    """One generated sequence, gathered from its outputs."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    finish: Finish | None = None  # how it ended, once it has
    error: str | None = None  # why it ended early, if it did
    first_output: OutputDelta | None = None  # carries prompt logprobs when asked
    embedding: Any = None  # an embedding request's vector (float32 [hidden]), once in
    # With return_hidden_states: an entry per token (hidden_states.py), as numpy arrays.
    hidden_states: list = dataclasses.field(default_factory=list)

    def add(self, output: OutputDelta) -> None:
        if self.first_output is None:
            self.first_output = output
        if output.hidden_states is not None:
            self.hidden_states.append(output.hidden_states)
        self.text += output.text
        if output.token_id is not None:
            self.token_ids.append(output.token_id)
            self.logprobs.append(output.logprob)
            self.top_logprobs.append([] if output.top_logprobs is None else output.top_logprobs)
        if output.finished:
            self.finish, self.error = output.finish, output.error
            self.embedding = output.embedding

    @property
    def finish_reason(self) -> str:
        return self.finish.reason

    @property
    def matched_stop(self) -> int | str | None:
        return self.finish.matched if self.finish.reason == "stop" else None


def sglang_output(choice: Choice, return_logprob: bool = False, top_logprobs_num: int = 0) -> dict:
    """SGLang's output dict: `text`, `output_ids`, `meta_info` (with `output_token_logprobs`
    [(logprob, token_id, None)] and `output_top_logprobs` when asked; `input_token_logprobs` and
    `input_top_logprobs` come in the final meta_info when the request asked for prompt logprobs).
    A choice still running (a /generate stream's event) has a partial meta_info. With
    return_hidden_states, `meta_info["hidden_states"]` is SGLang's list so far, as lists of
    floats: the prompt's rows [prompt][hidden], then a row [hidden] per later token."""
    meta_info = (choice.finish.meta_info() if choice.finish is not None else
                 {"id": None, "finish_reason": None, "completion_tokens": len(choice.token_ids)})
    if choice.error is not None:
        meta_info["error"] = choice.error
    if return_logprob or top_logprobs_num:
        meta_info["output_token_logprobs"] = [(lp, t, None) for lp, t in
                                              zip(choice.logprobs, choice.token_ids, strict=True)]
    if top_logprobs_num:
        meta_info["output_top_logprobs"] = [[(lp, t, None) for lp, t in alternatives]
                                            for alternatives in choice.top_logprobs]
    else:  # SGLang returns top alternatives only when asked for a number of them
        meta_info.pop("input_top_logprobs", None)
    if choice.hidden_states:
        meta_info["hidden_states"] = [entry.tolist() for entry in choice.hidden_states]
    return {"text": choice.text, "output_ids": choice.token_ids, "meta_info": meta_info}


class StreamBuffer:
    """One choice's outputs since its last SSE event: `--stream-interval` tokens go out together
    (and a speculative verified row's tokens, `OutputDelta.more`, in one event), and whatever is
    left goes out with the final output."""

    def __init__(self, interval: int):
        self.interval = interval
        self._outputs: list[OutputDelta] = []

    def add(self, output: OutputDelta) -> bool:
        """Holds the output; says whether the held ones should go out now."""
        self._outputs.append(output)
        if output.finished:
            return True
        return not output.more and sum(c.token_id is not None for c in self._outputs) >= self.interval

    def take(self) -> tuple[str, list[tuple]]:
        """(their text, (token id, logprob, alternatives) of each token), and empties it."""
        outputs, self._outputs = self._outputs, []
        return ("".join(c.text for c in outputs),
                [(c.token_id, c.logprob, [] if c.top_logprobs is None else c.top_logprobs)
                 for c in outputs if c.token_id is not None])
