"""An embedding: a sequence's hidden states pooled into one vector (issue 54), as
sentence-transformers pools them (weights/pooling.py reads which way from the checkpoint).

`pool_sequences(hidden [T, H], cu_q_lens i32[S + 1], mode, normalize) -> float32 [S, H]`: the
rows of a ragged batch (sequence s holds rows cu_q_lens[s] .. cu_q_lens[s + 1]; padding
sequences hold none and give zeros), each sequence's CLS (first row), mean or last row, then
L2-normalised as torch's `F.normalize` does (divided by max(norm, 1e-12)) where asked. `hidden`
is what the Transformer module outputs: for a decoder, after its final norm. Mean and CLS
pooling need a sequence's every row in one call; last-token pooling only its last.

A serving step runs a prompt in chunks (a decoder's KV cache carries the earlier ones), so it
returns each chunk's rows reduced, `reduce_chunks`: the first row (CLS), the sum (mean) or the
last row; the engine keeps the first chunk's, adds the sums up, or keeps the last chunk's, and
divides and normalises on the host (runtime/engine/pooled_outputs.py), where the whole input's
length is known.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

POOLING_MODES = ("cls", "mean", "last")
NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize uses


def reduce_chunks(hidden: jax.Array, cu_q_lens: jax.Array, mode: str) -> jax.Array:
    """float32 [S, H]: each chunk's first row (mode "cls"), row sum ("mean") or last row
    ("last"); zeros for a chunk of no rows (padding)."""
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling mode {mode!r} is not one of {POOLING_MODES}")
    hidden = hidden.astype(jnp.float32)
    tokens = hidden.shape[0]
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
    if mode == "mean":
        # Each row's sequence (rows past the last sequence's end: none of them, dropped).
        owner = jnp.searchsorted(ends, jnp.arange(tokens, dtype=ends.dtype), side="right",
                                 method="compare_all")
        reduced = jax.ops.segment_sum(hidden, owner, num_segments=starts.shape[0])
    else:
        reduced = hidden[jnp.clip(starts if mode == "cls" else ends - 1, 0, tokens - 1)]
    return jnp.where((ends > starts)[:, None], reduced, 0.0)


def pool_sequences(hidden: jax.Array, cu_q_lens: jax.Array, mode: str,
                   normalize: bool) -> jax.Array:
    pooled = reduce_chunks(hidden, cu_q_lens, mode)
    if mode == "mean":
        lengths = cu_q_lens[1:] - cu_q_lens[:-1]
        pooled = pooled / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    if normalize:
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        pooled = pooled / jnp.maximum(norm, NORMALIZE_EPS)
    return pooled
