"""What one serving step computes beyond a greedy argmax, decided on the host (issue 33, item 2).

The sampler's optional parts (penalties, the grammar mask, the random draw, top_k/top_p/min_p,
logprobs) and the prompt logprobs' LM head over every token row are needed only when some row
of the step asks for them, and the host knows which when it stages the step: each row's sampling
parameters, whether it sends grammar masks, whether a token row has a prompt-logprob target.

A step program takes a `StepNeeds | None` as a static argument:
- None (RUN_TIME, the CPU's one program per bucket): each part runs under a `lax.cond` on the
  same predicate, computed on the device. On the CPU a conditional costs nothing (the host runs
  the thunks), and one program per bucket keeps compile time and the tests' time as they were.
- a StepNeeds (TPU, GPU): each part is in the program (computed for every row, branch-free) or
  not at all. On a GPU a conditional copies its predicate to the host and waits mid-step, which
  also stalls the overlap schedule. `ACCELERATOR_VARIANTS` are the programs precompiled per
  bucket; the host runs the smallest one that covers the step (`program_needs`).

A part computed for every row gives the rows that do not ask for it what the skipped part would
(a penalty of 1.0 / 0.0 divides / subtracts exactly nothing, an all-ones bitmask masks nothing, a
row with top_k/top_p/min_p off keeps every token), so each variant returns the same tokens and
logprobs as the run-time program (tests/sampling/test_step_variants.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class StepNeeds:
    """True: some row of the step needs the part (or the program computes it anyway)."""

    penalties: bool = False  # repetition / frequency / presence penalty
    grammar: bool = False  # a grammar bitmask (structured outputs)
    sampling: bool = False  # a row that is not greedy: the random draw
    truncation: bool = False  # a sampling row with top_k / top_p / min_p
    logprobs: bool = False  # the chosen token's and the top logprobs
    prompt_logprobs: bool = False  # a prompt-logprob target: the LM head over every token row

    def covers(self, other: StepNeeds) -> bool:
        return all(mine or not theirs for mine, theirs in
                   zip(dataclasses.astuple(self), dataclasses.astuple(other)))

    def as_list(self) -> list[bool]:
        """For the multi-host step message (JSON)."""
        return list(dataclasses.astuple(self))


RUN_TIME = None  # every part decided by a lax.cond on the device: the CPU's program
PLAIN = StepNeeds()  # greedy rows, nothing else: the decode step of a benchmark or a batch of 1
# Everything the sampler can do, branch-free. What it adds to PLAIN in XLA's cost analysis of
# the deviceless H100 Llama-3.1-8B step at 256 rows (benchmarks/predict_accelerators.py
# --variants): 3.79 GB a step (40.47 -> 44.26 GB, ~1.1 ms of 3.35 TB/s on a ~17 ms step), of
# which truncation (top_k of 256 candidates and the exact search, truncation.py) 2.11 GB,
# penalties (the slots' count and prompt tables gathered) and logprobs (logsumexp, top_k) 1.41
# GB, the draw, scaling and grammar mask 0.27 GB; 0.27 GB at 8 rows. Only steps where some row
# samples, has a penalty or a grammar, or asks for logprobs pay it: greedy steps run PLAIN.
SAMPLED = StepNeeds(penalties=True, grammar=True, sampling=True, truncation=True, logprobs=True)
# + the LM head over every token row (its weights again, 1.05 GB, and 2 x rows x 4096 x 128256
# flops: 4.3 TFLOP for a 4096-token prefill of Llama-3.1-8B, ~4 ms of an H100): its own variant,
# so that no other step pays for it.
EVERYTHING = dataclasses.replace(SAMPLED, prompt_logprobs=True)
ACCELERATOR_VARIANTS = (PLAIN, SAMPLED, EVERYTHING)  # smallest first
VARIANT_NAMES = {RUN_TIME: "run-time", PLAIN: "plain", SAMPLED: "sampled",
                 EVERYTHING: "everything"}


# Which rows need a part: the same predicates on the host (numpy) and the device (jax arrays).
def penalty_rows(metadata):
    return ((metadata.repetition_penalty != 1.0) | (metadata.frequency_penalty != 0.0)
            | (metadata.presence_penalty != 0.0))


def greedy_rows(metadata):
    return (metadata.temperature <= 0) | (metadata.top_k == 1)


def truncating_rows(metadata):
    return ~greedy_rows(metadata) & ((metadata.top_k > 0) | (metadata.top_p < 1.0)
                                     | (metadata.min_p > 0))


def needs_of(metadata, target_ids, grammar: bool) -> StepNeeds:
    """A step's needs from its host arrays: `metadata` a SamplingMetadata of numpy arrays (one
    entry per row, padding rows included: greedy, everything off), `target_ids` the
    prompt-logprob targets of its token rows, `grammar` whether it sends grammar masks."""
    return StepNeeds(penalties=bool(np.any(penalty_rows(metadata))), grammar=grammar,
                     sampling=not np.all(greedy_rows(metadata)),
                     truncation=bool(np.any(truncating_rows(metadata))),
                     logprobs=bool(np.any(metadata.return_logprob)),
                     prompt_logprobs=bool(np.any(np.asarray(target_ids) >= 0)))


def program_needs(needs: StepNeeds | None, variants: Sequence[StepNeeds]) -> StepNeeds | None:
    """The smallest of `variants` (smallest first) that covers `needs`; RUN_TIME stays so."""
    if needs is RUN_TIME:
        return RUN_TIME
    for variant in variants:
        if variant.covers(needs):
            return variant
    raise ValueError(f"no step variant covers {needs}: the largest is {variants[-1]}")


def only_if_needed(needed: bool | None, predicate: Callable[[], jax.Array],
                   then: Callable[[], object], otherwise: Callable[[], object]):
    """`then()` where a step needs it. `needed` None: `lax.cond` on `predicate()` at run time;
    True: `then()`, branch-free; False: `otherwise()` (the host knows the predicate is false).
    `then()` must equal `otherwise()` wherever the predicate is false."""
    if needed is None:
        return jax.lax.cond(predicate(), then, otherwise)
    return then() if needed else otherwise()


def zeros_unless(flag: jax.Array, values, zeros):
    """`values` where `flag` (a scalar) holds, else `zeros` (pytrees alike): what a program that
    computes a part for every step returns where the run-time program skips it."""
    return jax.tree.map(lambda value, zero: jnp.where(flag, value, zero), values, zeros)


def part(needs: StepNeeds | None, name: str) -> bool | None:
    """One part's flag of `needs` (None for RUN_TIME)."""
    return None if needs is RUN_TIME else getattr(needs, name)
