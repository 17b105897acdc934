"""The simplest driver of the paged forward pass: a fixed set of sequences, pages handed out in
order, greedy decoding. It is what `python -m xlaserve.generate` runs until the engine (continuous
batching, sampling) lands, and the reference driver the model tests feed ragged batches through.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from xlaserve.model.transformer import AttentionMetadata
from xlaserve.runtime.kv_cache import NULL_PAGE, init_kv_pool
from xlaserve.pallas_kernels.ragged_paged_attention.api import get_attention_fn


def make_forward(model, attention_backend: str = "auto"):
    """A jitted `forward(state, input_ids, positions, kv_caches, metadata, logits_indices)` with
    the KV caches donated (updated in place)."""
    graphdef, _ = nnx.split(model)
    attention_fn = get_attention_fn(attention_backend)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def forward(state, input_ids, positions, kv_caches, metadata, logits_indices):
        return nnx.merge(graphdef, state)(
            input_ids, positions, kv_caches, metadata, logits_indices, attention_fn
        )

    return forward


class PagedBatch:
    """Host-side bookkeeping for a fixed list of sequences: each owns `pages_per_seq` pages."""

    def __init__(self, num_seqs: int, pages_per_seq: int, page_size: int):
        self.page_size = page_size
        first = NULL_PAGE + 1
        self.page_indices = np.arange(first, first + num_seqs * pages_per_seq, dtype=np.int32).reshape(
            num_seqs, pages_per_seq
        )
        self.lengths = np.zeros(num_seqs, np.int32)  # tokens already in the cache

    @property
    def num_pages(self) -> int:
        return self.page_indices.size + 1  # and the null page

    def step_inputs(self, chunks: list[list[int]], logits: str = "last"):
        """Inputs for one forward over `chunks[i]` new tokens of sequence i (may be empty).

        `logits` is "last" (one row per sequence with new tokens) or "all" (every new token).
        Returns (input_ids, positions, metadata, logits_indices, rows) where `rows` names the
        (sequence, position) of each logits row.
        """
        seqs = [i for i, chunk in enumerate(chunks) if chunk]
        input_ids, positions, cu_q_lens, kv_lens, rows, logits_indices = [], [], [0], [], [], []
        for i in seqs:
            chunk = chunks[i]
            start = int(self.lengths[i])
            input_ids += chunk
            positions += range(start, start + len(chunk))
            cu_q_lens.append(cu_q_lens[-1] + len(chunk))
            kv_lens.append(start + len(chunk))
            wanted = range(len(chunk)) if logits == "all" else [len(chunk) - 1]
            for r in wanted:
                logits_indices.append(cu_q_lens[-2] + r)
                rows.append((i, start + r))
            self.lengths[i] += len(chunk)
        # Pad tokens, sequences and logits rows to powers of two so few shapes get compiled; the
        # padding rows are dead (num_seqs and cu_q_lens say so).
        num_tokens, num_seqs = _pow2(len(input_ids)), _pow2(len(seqs))
        pad_seqs = num_seqs - len(seqs)
        metadata = AttentionMetadata(
            kv_lens=jnp.asarray(kv_lens + [0] * pad_seqs, jnp.int32),
            page_indices=jnp.asarray(np.pad(self.page_indices[seqs], ((0, pad_seqs), (0, 0)),
                                            constant_values=NULL_PAGE)),
            cu_q_lens=jnp.asarray(cu_q_lens + [cu_q_lens[-1]] * pad_seqs, jnp.int32),
            num_seqs=jnp.asarray([len(seqs)], jnp.int32),
        )
        pad = num_tokens - len(input_ids)
        logits_indices += [0] * (_pow2(len(logits_indices)) - len(logits_indices))
        return (jnp.asarray(input_ids + [0] * pad, jnp.int32),
                jnp.asarray(positions + [0] * pad, jnp.int32), metadata,
                jnp.asarray(logits_indices, jnp.int32), rows)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def greedy_generate(
    model, prompt_ids: list[int], max_new_tokens: int, *, page_size: int = 16,
    stop_token_ids: tuple[int, ...] = (), mesh: Mesh | None = None,
    attention_backend: str = "auto",
) -> list[int]:
    """Greedy decoding of one prompt; returns the new token ids (stopping at a stop id)."""
    config = model.config
    total = len(prompt_ids) + max_new_tokens
    batch = PagedBatch(1, -(-total // page_size), page_size)
    dtype = model.embedding.get_value().dtype
    mesh = mesh or model.embedding.get_value().sharding.mesh
    kv_caches = init_kv_pool(config, batch.num_pages, page_size, dtype, mesh)
    forward = make_forward(model, attention_backend)
    _, state = nnx.split(model)
    output: list[int] = []
    chunk = list(prompt_ids)
    for _ in range(max_new_tokens):
        input_ids, positions, metadata, logits_indices, _ = batch.step_inputs([chunk])
        logits, kv_caches = forward(state, input_ids, positions, kv_caches, metadata, logits_indices)
        token = int(jnp.argmax(logits[0]))
        output.append(token)
        if token in stop_token_ids:
            break
        chunk = [token]
    return output
