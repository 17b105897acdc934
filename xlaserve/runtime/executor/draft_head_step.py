"""A speculative draft head's device work (EAGLE3, NEXTN: model/draft_heads.py), as pure
functions of the step's arrays.

`catch_up_head` runs inside every serving step (step_program.make_step), after the target has
sampled: the head takes each token row at its position with the next token, which is the next
input token of the row's sequence, or where the row samples, the token the target sampled
there, or for a prompt chunk that ends before the prompt does, the prompt's next token
(`ForwardBatch.next_ids`). A verified row's sampled tokens are its accepted drafts and then the
target's own token, so its rows up to the last one kept get the tokens the request keeps; the
rows past it hold rejected drafts, whose cache entries the next step writes again. The head's
draft and state at each sequence's last kept row go to its slot: the next draft starts there.
(A prompt that starts with cached pages reads the head's entries another request wrote: the
last one before it was written with that request's next token, which costs acceptance if it
differs, never correctness; SGLang's radix cache shares the same way.)

`make_chain` is the program of the draft steps after that first draft (draft_head.py calls
it): `steps` single-token steps of the head, each on the last one's draft and state, for rows
sorted by their number of drafts (the rows still drafting at step j are a prefix; the others
are padding, which writes no cache).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.transformer import AttentionMetadata
from xlaserve.runtime.executor.page_table import apply_writes, gather_rows
from xlaserve.runtime.executor.weight_args import leaves_from_args


def catch_up_head(model, head, head_state, hidden, captured, input_ids, batch, metadata,
                  sampled, keep, sample_slots, kernels) -> list:
    """The head's pool entries after the step: [its cache, draft tokens, states]. `sampled`:
    the step's token per sample row; `keep`: the sample rows whose draft goes to their slot."""
    head_kv, draft_tokens, states = head_state
    tokens, rows = input_ids.shape[0], sampled.shape[0]
    token_row = jnp.full(tokens, -1, jnp.int32).at[
        jnp.where(batch.sample_rows, batch.logits_indices, tokens)].set(
            jnp.arange(rows, dtype=jnp.int32), mode="drop")
    next_ids = jnp.concatenate([input_ids[1:], input_ids[-1:]])
    ids = jnp.where(token_row >= 0, sampled[jnp.maximum(token_row, 0)], next_ids)
    # A prompt chunk's last token reads the prompt's next one, which the host sent.
    ends = jnp.where(batch.next_ids >= 0, batch.cu_q_lens[1:] - 1, tokens)
    ids = ids.at[ends].set(batch.next_ids, mode="drop")
    features = head.features(model, hidden, captured, kernels)
    x, head_kv = head(model.embedding[...], ids, features, batch.positions, head_kv, metadata,
                      kernels)
    x = x[batch.logits_indices]
    write = jnp.where(keep, sample_slots, draft_tokens.shape[0])
    draft_tokens = draft_tokens.at[write].set(head.draft(x, kernels), mode="drop")
    states = states.at[write].set(head.carry(x).astype(states.dtype), mode="drop")
    return [head_kv, draft_tokens, states]


def make_chain(graphdef, state_treedef, weight_layout, kernels, mesh, kv_sharding,
               num_layers: int, steps: int):
    """The jitted draft steps:

        chain(weights, kv_caches, page_table, ints, floats, rooms, *, layout)
            -> (drafts i32[S, steps + 1], kv_caches, page_table)

    over a staged batch of one token per row at each request's next position (its last token's,
    which the target has not run yet), `rooms` i32[S] the drafts each row wants, descending.
    Draft 0 is the one the last serving step made; draft j + 1 comes from step j."""
    replicated = NamedSharding(mesh, P())

    def chain(weights, kv_caches, page_table, ints, floats, rooms, layout):
        from xlaserve.runtime.executor.step_program import split_leaves

        batch, _, slots, _, writes = split_leaves(ints, floats, layout)
        state = jax.tree.unflatten(state_treedef, leaves_from_args(weights, weight_layout))
        model = nnx.merge(graphdef, state)
        head = model.draft_head
        head_kv, draft_tokens, states = kv_caches[num_layers:]
        page_table = apply_writes(page_table, writes)
        pages = gather_rows(page_table, slots, batch.pages)
        tokens, seqs = batch.input_ids.shape[0], slots.shape[0]
        token_slots = jnp.zeros(tokens, jnp.int32).at[:seqs].set(slots)  # tokens >= seqs
        ids, x_state = draft_tokens[token_slots], states[token_slots]
        drafts = [ids[:seqs]]
        seq_index = jnp.arange(seqs + 1, dtype=jnp.int32)
        for j in range(steps):
            live = jnp.minimum(jnp.sum(rooms > j + 1), batch.num_seqs[0]).astype(jnp.int32)
            metadata = AttentionMetadata(batch.kv_lens + j, pages,
                                         jnp.minimum(seq_index, live), live[None])
            x, head_kv = head(model.embedding[...], ids, x_state, batch.positions + j, head_kv,
                              metadata, kernels)
            ids, x_state = head.draft(x, kernels), head.carry(x)
            drafts.append(ids[:seqs])
        kv_caches = list(kv_caches[:num_layers]) + [head_kv, draft_tokens, states]
        return jnp.stack(drafts, axis=1), kv_caches, page_table

    return jax.jit(chain, static_argnames=("layout",), donate_argnums=(1, 2),
                   out_shardings=(replicated, kv_sharding, replicated))
