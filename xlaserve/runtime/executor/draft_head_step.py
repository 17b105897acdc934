"""A speculative draft head's device work (EAGLE3, NEXTN: model/draft_heads.py), as pure
functions of the step's arrays.

`catch_up_head` runs inside every serving step (step_program.make_step), after the target has
sampled: the head takes each token row at its position with the next token, which is the next
input token of the row's sequence, or where the row samples, the token the target sampled
there, or for a prompt chunk that ends before the prompt does, the prompt's next token
(`ForwardBatch.next_ids`). A verified row's sampled tokens are its accepted drafts and then the
target's own token, so its rows up to the last one kept get the tokens the request keeps; the
rows past it hold rejected drafts, whose cache entries the next step writes again. The head's
state at each sequence's last kept row goes to its slot: the next draft starts there. Its LM
head runs where a request drafts (drafts/draft_head.py), not here: a step with no draft to make
reads the head's layer alone (on the default model the LM head of a random head's 49152-token
vocabulary is bigger than the model's quantized weights).
(A prompt that starts with cached pages reads the head's entries another request wrote: the
last one before it was written with that request's next token, which costs acceptance if it
differs, never correctness; SGLang's radix cache shares the same way.)

The drafts are drafts/draft_head.py's program (`make_chain`) or drafts/draft_tree.py's.
"""
from __future__ import annotations

import jax.numpy as jnp


def catch_up_head(model, head, head_state, hidden, captured, input_ids, batch, metadata,
                  sampled, keep, sample_slots, kernels) -> list:
    """The head's pool entries after the step: [its cache, states]. `sampled`: the step's token
    per sample row; `keep`: the sample rows whose state goes to their slot."""
    head_kv, states = head_state
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
    write = jnp.where(keep, sample_slots, states.shape[0])
    states = states.at[write].set(head.carry(x).astype(states.dtype), mode="drop")
    return [head_kv, states]
