"""Speculative decoding inside the step: what a verified row's sample rows see and keep.

A verified row (runtime/scheduler/speculation.py) is a sequence whose new tokens are its last
token and its drafts, `[t, d1, ..., dk]`, with a sample row after each token (consecutive sample
rows of one sequence, `ForwardBatch.sample_seqs`). Two things of the device state depend on
which drafts the row keeps:
- the penalty counts: the token sampled after `d1..dj` comes from an output that holds those
  drafts, so row j counts them (`prior_draft_ids`);
- what the step keeps: the sampled tokens up to and including the first that differs from the
  draft after it (`kept_rows`, the rule the host applies too: speculation.accepted), so that the
  slot's penalty counts and last token are those of the accepted tokens, written in the step.
Pure functions of the step's arrays; a plain row is a sequence of one sample row, always kept.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _row_offsets(sample_seqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the first sample row of each row's sequence, the row's offset from it), i32[R] each."""
    index = jnp.arange(sample_seqs.shape[0], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones(1, jnp.bool_), sample_seqs[1:] != sample_seqs[:-1]])
    first = jax.lax.cummax(jnp.where(starts, index, 0))
    return first, index - first


def prior_draft_ids(input_ids: jax.Array, logits_indices: jax.Array, sample_seqs: jax.Array,
                    max_drafts: int) -> jax.Array:
    """i32[R, max_drafts]: the drafts before each sample row's token in its verified row
    (`d1..dj` for row j), -1 elsewhere: row j's token follows input token `first + j`, and the
    drafts are the inputs after the row's first."""
    first, offset = _row_offsets(sample_seqs)
    k = jnp.arange(max_drafts, dtype=jnp.int32)
    positions = logits_indices[first][:, None] + 1 + k[None, :]
    ids = input_ids[jnp.minimum(positions, input_ids.shape[0] - 1)]
    live = (k[None, :] < offset[:, None]) & (sample_seqs[:, None] >= 0)
    return jnp.where(live, ids, -1)


def kept_rows(tokens: jax.Array, input_ids: jax.Array, logits_indices: jax.Array,
              sample_seqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(kept, last kept), bool[R] each: a sample row is kept when every earlier row of its
    sequence sampled the draft that follows it; the last kept row's token is the sequence's
    next input."""
    same_next = jnp.concatenate([(sample_seqs[1:] == sample_seqs[:-1]) & (sample_seqs[1:] >= 0),
                                 jnp.zeros(1, jnp.bool_)])
    next_input = input_ids[jnp.minimum(logits_indices + 1, input_ids.shape[0] - 1)]
    mismatch = (same_next & (tokens != next_input)).astype(jnp.int32)
    before = jnp.cumsum(mismatch) - mismatch  # mismatches in the rows before each one
    first, _ = _row_offsets(sample_seqs)
    kept = before == before[first]
    kept_next = jnp.concatenate([kept[1:], jnp.zeros(1, jnp.bool_)])
    return kept, kept & ~(same_next & kept_next)
