"""How many tokens one step may hold: the prompt tokens beside the decodes (`prefill_budget`,
the scheduler's rule) and the most any step holds (`max_step_tokens`, the largest padding bucket
the executor compiles)."""
from __future__ import annotations


def prefill_budget(max_prefill_tokens: int, num_decodes: int) -> int:
    """Prompt tokens a step may run beside `num_decodes` decode rows. As in SGLang's mixed
    chunks, decodes take their share of `max_prefill_tokens`, so a mixed step is no bigger than a
    prefill step (and pads to the same bucket, not the next one up); prompts keep at least a
    quarter of it, so new requests still start under a full decode load."""
    return max(max_prefill_tokens - num_decodes, max_prefill_tokens // 4, 1)


def max_step_tokens(max_running_requests: int, max_prefill_tokens: int) -> int:
    """The most tokens one step can hold (`prefill_budget` beside every running request decoding,
    or a whole prefill step)."""
    return max(max_prefill_tokens,
               max_running_requests + prefill_budget(max_prefill_tokens, max_running_requests))
