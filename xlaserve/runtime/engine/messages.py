"""The typed messages that cross between the engine's threads and stages.

- Into the engine loop (any thread -> the loop thread, through EngineCore's inbox): `AddRequest`
  (EngineCore.submit), `Abort` (abort), `AbortAll` (abort_all), `FlushCache` (flush_cache, which
  waits on its future) and `Wake` (shutdown: unblocks a loop waiting on an empty inbox).
  From the output thread (live_requests.py): `RequestsEnded`, the requests it ended (`StopMatched`: a
  stop string; `DropRequest`: a failure of its own or a sink that raised), for the loop to end in
  the scheduler. `InboxMessage` is their union.
- From a step to its output: `GenerationSteps.read` turns a step's sampled tokens into a
  `StepResult` (the step-wide logprob arrays and one `SampledRow` per row that sampled for a
  live request), which `LiveRequests.deliver` queues for the output thread to make into outputs;
  an embedding server's step becomes a `PooledResult` (the requests it finished, their vectors).
- Out of the engine (the output thread -> the request's consumer, through its `emit` callback):
  one `OutputDelta` per sampled token, and a final one without a token when a request ends early
  (an abort, a refusal, a failure). Consumers that need SGLang's JSON shape (offline.Engine,
  /generate) build their dicts from it; its `Finish` gives SGLang's `meta_info` (`meta_info()`).
"""
from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from xlaserve.runtime.engine.detokenizer import IncrementalDetokenizer
    from xlaserve.runtime.engine.hidden_states import PromptRows
    from xlaserve.runtime.sampling.prompt_logprobs import PromptLogprobCollector
    from xlaserve.runtime.scheduler.request import Request, SampledRow


# --- the inbox: any thread -> the engine loop ---------------------------------------------------

@dataclasses.dataclass
class LiveRequest:
    """Engine-side state of one admitted request (live_requests.py keeps it by id): its sink, its
    detokenizer, its prompt-logprob collector."""

    request: Request
    emit: Callable[[OutputDelta], None]
    detokenizer: IncrementalDetokenizer | None
    top_logprobs_num: int = 0  # alternatives per token in the outputs (needs return_logprob)
    prompt_logprobs: PromptLogprobCollector | None = None  # with return_prompt_logprob
    prompt_logprobs_sent: bool = False  # they go out once, with the first output
    hidden_states: PromptRows | None = None  # with return_hidden_states (hidden_states.py)
    done: bool = False  # its final output has been handed out (the output thread's flag alone)


@dataclasses.dataclass(frozen=True, slots=True)
class AddRequest:
    """A submitted request, its state built and checked in the submitting thread."""

    live: LiveRequest


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """End the request `rid` (waiting or running); its final output carries `message` as error."""

    rid: str
    message: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class AbortAll:
    """End every request the engine holds, each with `message` as its error."""

    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class FlushCache:
    """Empty the prefix cache between steps; `done` gets the pages freed (or the error)."""

    done: Future


def settle(done: Future, run: Callable[[], Any]) -> None:
    """`done` gets `run()`'s result, or its error (a caller waits on it: it must hear either)."""
    try:
        done.set_result(run())
    except Exception as error:
        done.set_exception(error)


@dataclasses.dataclass(frozen=True, slots=True)
class OnLoop:
    """Work a feature has the loop do between steps (a LoRA adapter's slot write, the end of an
    unload: lora_adapters.py): `run()`, which sets `done` (its result or error)."""

    run: Callable[[], None]
    done: Future


@dataclasses.dataclass(frozen=True, slots=True)
class StopMatched:
    """The output thread found stop string `stop` in the request's text (its final output waits
    for the loop to end the request)."""

    rid: str
    stop: str


@dataclasses.dataclass(frozen=True, slots=True)
class DropRequest:
    """The output thread failed the request, or its sink raised: abort it, with no other output."""

    rid: str


@dataclasses.dataclass(frozen=True, slots=True)
class RequestsEnded:
    """Requests the output thread ended; the loop sets `done` once it has ended them in the
    scheduler (their slots and pages free)."""

    requests: tuple[StopMatched | DropRequest, ...]
    done: threading.Event


@dataclasses.dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do: wakes a loop blocked on an empty inbox (to see that it is stopping)."""


InboxMessage = AddRequest | Abort | AbortAll | FlushCache | OnLoop | RequestsEnded | Wake


# --- a step's sampled tokens: GenerationSteps.read -> LiveRequests.deliver (the loop thread) -------

@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """The rows of a step that sampled for a live request, in row order, and the step's logprob
    arrays (read from the device only when one of its rows asked for logprobs, else None)."""

    rows: list[SampledRow]
    logprobs: Any = None  # f32[rows]: each row's sampled token's logprob
    top_logprobs: Any = None  # f32[rows, k]: each row's best alternatives' logprobs
    top_ids: Any = None  # i32[rows, k]: their token ids
    # {sample row: its token's hidden-state entry} of the rows whose request asked for them
    # (hidden_states.py); None when none did.
    hidden_states: dict | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PooledResult:
    """An embedding server's step, read: each request it finished, with its embedding
    (float32 [hidden]; runtime/engine/pooled_outputs.py)."""

    rows: list[tuple[Request, Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    """How a request ended, on its final OutputDelta: SGLang's `meta_info` as fields."""

    rid: str
    reason: str  # "stop", "length" or "abort"
    matched: int | str | None  # with "stop": the stop id or string that ended it (None: EOS-less)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Once all in, for a request that asked for prompt logprobs: SGLang's lists.
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    # Speculative decoding: the verified rows the request ran and the drafts they accepted.
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    queued_s: float = 0.0  # from arrival to its first step (0: never scheduled)
    weight_version: str = "default"  # of the weights that sampled its last token

    def meta_info(self) -> dict:
        """SGLang's `meta_info` dict (the offline API and /generate return it)."""
        finish_reason: dict = {"type": self.reason}
        if self.reason == "length":
            finish_reason["length"] = self.completion_tokens
        elif self.reason == "stop":
            finish_reason["matched"] = self.matched
        info = {"id": self.rid, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "finish_reason": finish_reason, "weight_version": self.weight_version}
        if self.spec_verify_ct:  # SGLang's count, and tokens per verified row
            info["spec_verify_ct"] = self.spec_verify_ct
            info["spec_accept_length"] = round(
                1 + self.spec_accepted_drafts / self.spec_verify_ct, 4)
        if self.input_token_logprobs is not None:
            info["input_token_logprobs"] = self.input_token_logprobs
            info["input_top_logprobs"] = self.input_top_logprobs
        return info


# --- the engine -> a request's consumer (its `emit`, called on the loop thread) ---------------

@dataclasses.dataclass(frozen=True, slots=True)
class OutputDelta:
    """One piece of a request's output: a sampled token and its text delta, or (`token_id` None)
    the final output of a request that ended without one.

    `logprob` and `top_logprobs` [(logprob, token_id)] are set with return_logprob;
    `input_token_logprobs` and `input_top_logprobs` (SGLang's lists) on the first output of a
    request that asked for prompt logprobs; `finish` (how it ended: id, token counts, reason) on
    the final output; `error` on a final output that ended the request
    early with a message. `more`: this request's next output, from the same step, follows at
    once (a speculative verified row's tokens), so a stream sends them as one event. An
    embedding request (an embedding server's) has one output: final, no token, `embedding`.
    `hidden_states`: with return_hidden_states, the token's entry of SGLang's list
    (hidden_states.py): the prompt's rows f32[prompt, hidden] with the first token, then
    f32[hidden]."""

    token_id: int | None
    text: str
    finished: bool
    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    finish: Finish | None = None
    error: str | None = None
    more: bool = False
    embedding: Any = None  # an embedding request's vector (float32 [hidden]), on its one output
    hidden_states: Any = None
