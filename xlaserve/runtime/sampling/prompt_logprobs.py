"""Prompt (input) token logprobs, for OpenAI's `echo` + `logprobs` and SGLang's
`logprob_start_len=0`: log p(prompt[i] | prompt[:i]) for every prompt token after the first, and
the top alternatives at each of those positions, under the raw model distribution (log_softmax of
the logits: no bias, penalties or temperature).

Device side (`prompt_logprobs`, inside the jitted step): every token row t of the packed batch
has a target id `target_ids[t]`, the prompt token that follows it, or -1. Only when some row has
a target does the step run the LM head over all rows: on the CPU a `lax.cond` on that data keeps
one program per bucket, and an ordinary step skips the work at run time; on an accelerator the
host picks a program with the LM head or without it (runtime/sampling/step_needs.py).

Host side (`PromptLogprobCollector`, in the engine): builds a request's targets for each of its
prefill chunks (the target of a chunk's last token is the next chunk's first one) and gathers the
results by position, so a request that is retracted and recomputed fills no entry twice.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.runtime.sampling.step_needs import only_if_needed, zeros_unless
from xlaserve.runtime.sampling.truncation import row_take

NO_TARGET = -1
# Rows per LM-head block: the logits of a block, f32[block, V], are what the branch holds at a
# time (256 x 49152 vocab = 48 MiB), whatever the step's token bucket.
LOGPROB_BLOCK_ROWS = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobs:
    logprobs: jax.Array  # f32[T]; of target_ids[t] at row t, 0 where there is no target
    top_ids: jax.Array  # i32[T, N]; most likely first
    top_logprobs: jax.Array  # f32[T, N]


def _block_logprobs(logits_fn, hidden, target_ids, num_top: int):
    logits = logits_fn(hidden).astype(jnp.float32)
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    target = row_take(logits, jnp.maximum(target_ids, 0)) - log_norm
    top_values, top_ids = jax.lax.top_k(logits, num_top)
    return (jnp.where(target_ids >= 0, target, 0.0), top_ids.astype(jnp.int32),
            top_values - log_norm[:, None])


def _all_rows(logits_fn, hidden, target_ids, num_top: int) -> PromptLogprobs:
    """Every row, in blocks of LOGPROB_BLOCK_ROWS (a sequential map), so the memory held is one
    block's logits rather than [T, V]."""
    num_rows, width = hidden.shape
    block = min(num_rows, LOGPROB_BLOCK_ROWS)
    pad = -num_rows % block
    blocks = (jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, block, width),
              jnp.pad(target_ids, (0, pad), constant_values=NO_TARGET).reshape(-1, block))
    logprobs, top_ids, top_logprobs = jax.lax.map(
        lambda args: _block_logprobs(logits_fn, *args, num_top), blocks)
    return PromptLogprobs(logprobs.reshape(-1)[:num_rows],
                          top_ids.reshape(-1, num_top)[:num_rows],
                          top_logprobs.reshape(-1, num_top)[:num_rows])


def prompt_logprobs(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                    target_ids: jax.Array, num_top: int,
                    needed: bool | None = None) -> PromptLogprobs:
    """`logits_fn` maps hidden rows f32[R, H] to logits [R, V] (the model's final norm + LM head);
    `hidden` f32[T, H] are the final hidden states of every token row. Zeros when no row has a
    target, without running the LM head. `needed` (static): None decides at run time whether
    some row has a target; True runs the LM head, False does not (step_needs.only_if_needed)."""
    num_rows = hidden.shape[0]
    skipped = PromptLogprobs(jnp.zeros(num_rows, jnp.float32),
                             jnp.zeros((num_rows, num_top), jnp.int32),
                             jnp.zeros((num_rows, num_top), jnp.float32))
    any_target = jnp.any(target_ids >= 0)

    def computed():
        # Zeros in a step without a target, as when it is skipped: f32/i32[T, N], next to nothing.
        return zeros_unless(any_target, _all_rows(logits_fn, hidden, target_ids, num_top), skipped)

    return only_if_needed(needed, lambda: any_target, computed, lambda: skipped)


class PromptLogprobCollector:
    """One request's prompt logprobs as its prefill chunks compute them. Entry i (for prompt
    token i) comes from the row of token i-1; entry 0 has none. Entries [1, num_collected) are
    filled; chunks run in prompt order, so that is a prefix, and after a retraction the
    recomputed chunks ask for nothing below it."""

    def __init__(self, prompt_ids: list[int], top_n: int):
        self.prompt_ids = np.asarray(prompt_ids, np.int32)
        n = len(prompt_ids)
        self.top_n = top_n
        self.logprobs = np.zeros(n, np.float32)
        self.top_ids = np.zeros((n, top_n), np.int32)
        self.top_logprobs = np.zeros((n, top_n), np.float32)
        self.num_collected = 1

    @property
    def complete(self) -> bool:
        return self.num_collected >= len(self.prompt_ids)

    def _wanted(self, num_cached: int, num_tokens: int) -> np.ndarray:
        """The entries (= positions + 1) that rows [num_cached, num_cached + num_tokens) fill."""
        entries = np.arange(num_cached + 1, num_cached + num_tokens + 1)
        return entries[(entries >= self.num_collected) & (entries < len(self.prompt_ids))]

    def targets(self, num_cached: int, num_tokens: int) -> np.ndarray:
        """i32[num_tokens]: each row's target for a chunk of `num_tokens` tokens starting at
        position `num_cached` (the next prompt token, or NO_TARGET)."""
        targets = np.full(num_tokens, NO_TARGET, np.int32)
        entries = self._wanted(num_cached, num_tokens)
        targets[entries - 1 - num_cached] = self.prompt_ids[entries]
        return targets

    def collect(self, num_cached: int, logprobs, top_ids, top_logprobs) -> None:
        """Stores the rows of one chunk (the step's output rows of that chunk, in order)."""
        entries = self._wanted(num_cached, len(logprobs))
        if len(entries) == 0:
            return
        rows = entries - 1 - num_cached
        self.logprobs[entries] = logprobs[rows]
        self.top_ids[entries] = top_ids[rows, :self.top_n]
        self.top_logprobs[entries] = top_logprobs[rows, :self.top_n]
        self.num_collected = max(self.num_collected, int(entries[-1]) + 1)

    def sglang_lists(self) -> tuple[list, list]:
        """(input_token_logprobs [(logprob | None, token_id, None)], input_top_logprobs
        [None | [(logprob, token_id, None)]]), one entry per prompt token, as SGLang returns them."""
        ids = self.prompt_ids.tolist()
        token_logprobs = [(None, ids[0], None)] + [
            (lp, t, None) for lp, t in zip(self.logprobs[1:].tolist(), ids[1:], strict=True)]
        top = [None] + [
            [(lp, t, None) for lp, t in zip(lps, tids, strict=True)]
            for lps, tids in zip(self.top_logprobs[1:].tolist(), self.top_ids[1:].tolist(), strict=True)]
        return token_logprobs, top
