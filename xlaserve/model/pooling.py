"""An embedding: a sequence's hidden states pooled into one vector (issue 54), as
sentence-transformers pools them (weights/pooling.py reads which way from the checkpoint).

`pool_sequences(hidden [T, H], cu_q_lens i32[S + 1], mode, normalize) -> float32 [S, H]`: the
rows of a ragged batch (sequence s holds rows cu_q_lens[s] .. cu_q_lens[s + 1]; padding
sequences hold none and give zeros), each sequence's CLS (first row), mean or last row, then
L2-normalised as torch's `F.normalize` does (divided by max(norm, 1e-12)) where asked. `hidden`
is what the Transformer module outputs: for a decoder, after its final norm. Mean and CLS
pooling need a sequence's every row in one call; last-token pooling only its last.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

POOLING_MODES = ("cls", "mean", "last")
NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize uses


def pool_sequences(hidden: jax.Array, cu_q_lens: jax.Array, mode: str,
                   normalize: bool) -> jax.Array:
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling mode {mode!r} is not one of {POOLING_MODES}")
    hidden = hidden.astype(jnp.float32)
    tokens = hidden.shape[0]
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
    lengths = ends - starts
    if mode == "mean":
        # Each row's sequence (rows past the last sequence's end: none of them, dropped).
        owner = jnp.searchsorted(ends, jnp.arange(tokens, dtype=ends.dtype), side="right",
                                 method="compare_all")
        sums = jax.ops.segment_sum(hidden, owner, num_segments=starts.shape[0])
        pooled = sums / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    else:
        row = starts if mode == "cls" else ends - 1
        pooled = hidden[jnp.clip(row, 0, tokens - 1)]
    pooled = jnp.where((lengths > 0)[:, None], pooled, 0.0)
    if normalize:
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        pooled = pooled / jnp.maximum(norm, NORMALIZE_EPS)
    return pooled
