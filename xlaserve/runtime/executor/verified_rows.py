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
A hybrid model's linear layers keep a state the step rolls back to the kept tokens
(`StateRollback`, at the end).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.linear_attention import VerifiedRows
from xlaserve.model.transformer import AttentionMetadata


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


# --- tree rows (--speculative-eagle-topk > 1) -------------------------------------------------
#
# A tree row's tokens are its root and drafted nodes, each after its parent; a token's tree mask
# (ForwardBatch.tree_masks) names its ancestors and itself by their offsets in the row, and its
# sample row is the row's first plus its offset. The step keeps the path the target's tokens
# walk: a node is kept when the token sampled after each of its ancestors is the next node on
# the way to it. Plain rows (mask 1) and chains are trees too, so these serve a tree step's
# every row. The kept nodes' KV moves from the slots they were written at (the row's start +
# offset) to their positions (start + depth): `kept_path_moves`.


def _tree_columns(input_ids, tree_masks, logits_indices, sample_seqs, cu_q_lens, width: int):
    """Per sample row and offset k of its row (i32[R, width] each): whether node k is in the
    row and an ancestor-or-self of the row's node, and node k's token; and per row its first
    sample row."""
    row_start = cu_q_lens[jnp.maximum(sample_seqs, 0)]
    first, _ = _row_offsets(sample_seqs)
    k = jnp.arange(width, dtype=jnp.int32)
    node_token = jnp.minimum(row_start[:, None] + k[None, :], input_ids.shape[0] - 1)
    mine = tree_masks[logits_indices]
    on_path = ((mine[:, None] >> k[None, :]) & 1).astype(jnp.bool_) & (sample_seqs >= 0)[:, None]
    return on_path, node_token, first


def tree_prior_draft_ids(input_ids, tree_masks, logits_indices, sample_seqs, cu_q_lens,
                         max_drafts: int):
    """`prior_draft_ids` of a tree step: the drafts on the way to each sample row's node (its
    ancestors but the root, and itself), -1 elsewhere."""
    on_path, node_token, _ = _tree_columns(input_ids, tree_masks, logits_indices, sample_seqs,
                                           cu_q_lens, max_drafts + 1)
    ids = jnp.where(on_path, input_ids[node_token], -1)
    return ids[:, 1:]  # offset 0 is the root: the request's own token


def tree_kept_rows(tokens, input_ids, tree_masks, logits_indices, sample_seqs, cu_q_lens,
                   width: int):
    """(kept, last kept, depth), per sample row of a tree step: kept when the target's token
    after each ancestor of its node is the next node of the way to it; the last kept is the
    deepest (siblings' tokens are distinct: one path is kept)."""
    on_path, node_token, first = _tree_columns(
        input_ids, tree_masks, logits_indices, sample_seqs, cu_q_lens, width)
    masks = tree_masks[node_token]  # each node's own mask
    own = jnp.left_shift(1, jnp.arange(width, dtype=jnp.int32))[None, :]
    parent = 31 - jax.lax.clz(masks & ~own)  # the highest other bit; -1... for the root
    parent_row = jnp.clip(first[:, None] + parent, 0, tokens.shape[0] - 1)
    matched = tokens[parent_row] == input_ids[node_token]
    k = jnp.arange(width, dtype=jnp.int32)[None, :]
    kept = jnp.all(~on_path | matched | (k == 0), axis=1) & (sample_seqs >= 0)
    depth = jnp.sum(on_path, axis=1, dtype=jnp.int32) - 1
    num_seqs = cu_q_lens.shape[0] - 1
    deepest = jnp.full(num_seqs, -1, jnp.int32).at[
        jnp.where(kept, sample_seqs, num_seqs)].max(depth, mode="drop")
    last_kept = kept & (depth == deepest[jnp.maximum(sample_seqs, 0)])
    return kept, last_kept, depth


def kept_path_moves(kept, depth, logits_indices, sample_seqs, cu_q_lens, kv_lens, page_indices,
                    page_size: int, num_pages: int):
    """((source page, slot), (destination page, slot)) i32[R] each of the kept nodes' cache
    entries: from where the attention wrote node i (its row's first position + i) to its
    position (+ its depth); rows that stay or are not kept go to page `num_pages` (dropped)."""
    seq = jnp.maximum(sample_seqs, 0)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    first_pos = kv_lens[seq] - q_len
    offset = logits_indices - cu_q_lens[seq]
    source, target = first_pos + offset, first_pos + depth
    move = kept & (offset != depth)
    pages = page_indices[seq]

    def page_slot(pos, live):
        page = jnp.take_along_axis(pages, jnp.clip(pos // page_size, 0, pages.shape[1] - 1)[:, None],
                                   axis=1)[:, 0]
        return jnp.where(live, page, num_pages), pos % page_size

    return page_slot(source, move), page_slot(target, move)


def move_kv_entries(kv_caches, source, target):
    """Each cache [pages, page_size, ...] with the entries at `source` (pages, slots) copied to
    `target` (pages, slots); a target page of `num_pages` is dropped. All reads come before the
    writes (a path's sources lie at or after its targets)."""
    src_page, src_slot = source
    dst_page, dst_slot = target
    moved = []
    for cache in kv_caches:
        rows = cache.at[src_page, src_slot].get(mode="clip")
        moved.append(cache.at[dst_page, dst_slot].set(rows, mode="drop"))
    return moved


# --- a hybrid model's linear-layer states (issue 76) -------------------------------------------
#
# A linear layer's state is not a cache of positions the next step can overwrite: after a verified
# row `[t, d1, ..., dk]` it holds every draft, accepted or not. So in a speculative step (a program
# with verified rows, `verify_tokens` > 1) a sequence with more than one sample row (a verified
# row) leaves its slot as it was and its layers keep the inputs of its rows
# (linear_attention.VerifiedRows, PendingRows); when the step knows which sample rows it keeps
# (`kept_rows`), each layer advances the slot by the row's first `kept` tokens (its state's
# `commit_accepted`: Gated DeltaNet's, Mamba-2's). Every other row (a prompt chunk, a plain
# decode) writes its state as in any step. A model without linear layers, or a server without
# speculation, gets `NO_ROLLBACK`, which does nothing.


def _sample_rows_of(sample_seqs: jax.Array, num_seqs: int, rows: jax.Array) -> jax.Array:
    """i32[S]: how many of `rows` (bool[R], per sample row) each sequence has."""
    index = jnp.where((sample_seqs >= 0) & rows, sample_seqs, num_seqs)  # the others dropped
    return jnp.zeros(num_seqs, jnp.int32).at[index].add(1, mode="drop")


@dataclasses.dataclass(frozen=True)
class StateRollback:
    """The speculative step's hooks for a model with linear layers (`state_rollback`)."""

    verify_tokens: int  # a verified row's tokens at most
    first: int  # the first linear layer's pools among the step's caches
    count: int  # linear layers

    def metadata(self, metadata: AttentionMetadata, sample_seqs: jax.Array) -> AttentionMetadata:
        """`metadata` with the step's VerifiedRows: a sequence of two or more sample rows is
        verified (a plain decode and a prompt's last chunk have one, other chunks none)."""
        seqs = metadata.kv_lens.shape[0]
        verified = _sample_rows_of(sample_seqs, seqs, jnp.ones_like(sample_seqs, bool)) > 1
        last_row = metadata.cu_q_lens[-1] - 1  # any row: a padding sequence's are not read
        rows = metadata.cu_q_lens[:-1, None] + jnp.arange(self.verify_tokens)[None, :]
        return dataclasses.replace(metadata, verified_rows=VerifiedRows(
            writes=(~verified).astype(jnp.int32), rows=jnp.clip(rows, 0, jnp.maximum(last_row, 0))))

    def commit(self, caches: list, metadata: AttentionMetadata, kept: jax.Array,
               sample_seqs: jax.Array) -> list:
        """`caches` with each verified sequence's slot advanced by its kept tokens (one per kept
        sample row: its last token and the drafts accepted), the pending rows dropped."""
        seqs = metadata.kv_lens.shape[0]
        kept_lens = _sample_rows_of(sample_seqs, seqs, kept)
        verified = metadata.verified_rows.writes == 0
        layers = slice(self.first, self.first + self.count)
        return caches[:self.first] + [
            state.commit_accepted(kept_lens, metadata.state_slots, verified)
            for state in caches[layers]] + caches[layers.stop:]


class NoStateRollback:
    """No linear layers, or no verified rows: nothing to keep or commit."""

    def metadata(self, metadata: AttentionMetadata, sample_seqs: jax.Array) -> AttentionMetadata:
        return metadata

    def commit(self, caches: list, metadata: AttentionMetadata, kept: jax.Array,
               sample_seqs: jax.Array) -> list:
        return caches


NO_ROLLBACK = NoStateRollback()


def state_rollback(config: ModelConfig, verify_tokens: int) -> StateRollback | NoStateRollback:
    """The rollback of a step program of this model with verified rows of `verify_tokens`."""
    if verify_tokens <= 1 or not config.state_layers:
        return NO_ROLLBACK
    return StateRollback(verify_tokens, len(config.cache_layers), len(config.state_layers))
