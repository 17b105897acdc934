"""The one check of what a request asks, made before anything is built or queued for it.

`check_request` decides whether the engine could ever serve a request: its sampling parameters
typed and in range (`SamplingParams.validate`, under the server's `RequestLimits`), its number of
top logprobs, the ids that end it (at most MAX_SUPPRESSED_IDS: `stop_token_set`), and whether its
prompt plus max_new_tokens fits (`Scheduler.check_fits`, the scheduler's one fits decision). Its
refusals are typed: InvalidSamplingParam naming the field, RequestTooLong with the numbers.

`EngineCore.submit` runs it on every request (the offline API's included); the HTTP routes run it
through `EngineCore.check_request` before submitting a call's n copies, so a bad call submits
nothing, and answer its errors as OpenAI's 400s at their boundary (http/serving.py). It compiles
no grammar: the HTTP layer compiles off its event loop (http/constraints.py), and submit's
`compile_grammar` then hits the cache. It reads only what start-up fixed (the limits, the
vocabulary, the context length and the pool's size), so any thread may call it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from xlaserve.runtime.sampling.params import (MAX_TOP_LOGPROBS, InvalidSamplingParam, RequestLimits,
                                      SamplingParams, stop_token_set)

if TYPE_CHECKING:
    from xlaserve.runtime.scheduler.scheduler import Scheduler


def check_request(scheduler: Scheduler, limits: RequestLimits, vocab_size: int,
                  eos_token_ids: frozenset[int] | set[int], prompt_len: int,
                  params: SamplingParams, top_logprobs_num: int = 0, *,
                  names: dict[str, str] | None = None,
                  template_stop_ids: frozenset[int] = frozenset()) -> None:
    """Raises InvalidSamplingParam (a bad value, named) or RequestTooLong (prompt_len plus
    max_new_tokens over what one request may hold), both ValueErrors, or ValueError for an empty
    prompt. `names` renames fields in the messages and `param` (the OpenAI routes say max_tokens
    for max_new_tokens: SamplingParams.validate); `template_stop_ids`: the chat template's
    end-of-turn ids the caller adds to stop_token_ids after this check (`stop_token_set`)."""
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise InvalidSamplingParam(
            "top_logprobs_num", f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
    params.validate(vocab_size, names=names, limits=limits)
    stop_token_set(params, eos_token_ids, template_stop_ids)
    scheduler.check_fits(prompt_len, params.max_new_tokens)
