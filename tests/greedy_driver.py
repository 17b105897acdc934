"""The simplest driver of the paged forward pass: a fixed set of sequences, pages handed out in
order, greedy decoding; no engine, scheduler or sampler. The reference driver the model and weight
tests feed ragged batches through, and what the runner's batched steps are compared with
(tests/executor/test_model_runner.py). Test code only: the package serves through
xlaserve/runtime/executor/model_runner.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from xlaserve.runtime.executor.forward_batch import make_forward_batch

from xlaserve.runtime.scheduler.request import SeqChunk
from xlaserve.runtime.executor.buckets import buckets_for_limits, pow2_buckets
from xlaserve.runtime.executor.kv_pool import init_kv_pool
from xlaserve.runtime.scheduler.page_allocator import NULL_PAGE
from xlaserve.runtime.executor.kernels import kernels_for


def make_forward(model, attention_backend: str = "auto", mla_expanded_prefill_tokens: int = 0,
                 round_projections: bool = False, mxfp4_interpreted: bool = False,
                 kernels=None):
    """A jitted `forward(state, input_ids, positions, kv_caches, metadata, logits_indices)` with
    the KV caches donated (updated in place). `round_projections`: the GPU's precision
    (layers.Kernels.round_projections) on this CPU; `mxfp4_interpreted`: experts kept in MXFP4
    multiplied by the GPU's kernel, interpreted. `kernels`: these (layers.Kernels) in place of
    the platform's."""
    graphdef, _ = nnx.split(model)
    kernels = kernels or kernels_for(attention_backend, _mesh_of(model),
                                     mla_expanded_prefill_tokens=mla_expanded_prefill_tokens)
    kernels = dataclasses.replace(kernels, round_projections=round_projections)
    if mxfp4_interpreted:
        from xlaserve.pallas_kernels.grouped_matmul_mxfp4 import grouped_matmul_mxfp4

        kernels = dataclasses.replace(kernels, mxfp4_grouped_matmul=functools.partial(
            grouped_matmul_mxfp4, interpret=True))

    @functools.partial(jax.jit, donate_argnums=(3,))
    def forward(state, input_ids, positions, kv_caches, metadata, logits_indices):
        return nnx.merge(graphdef, state)(
            input_ids, positions, kv_caches, metadata, logits_indices, kernels
        )

    return forward


def _mesh_of(model) -> Mesh | None:
    """The mesh the model's parameters are placed on (None for unplaced ones)."""
    sharding = getattr(jax.tree.leaves(nnx.state(model))[0], "sharding", None)
    return getattr(sharding, "mesh", None)


class PagedBatch:
    """Host-side bookkeeping for a fixed list of sequences: each owns `pages_per_seq` pages."""

    def __init__(self, num_seqs: int, pages_per_seq: int, page_size: int):
        self.page_size = page_size
        first = NULL_PAGE + 1
        self.page_indices = np.arange(first, first + num_seqs * pages_per_seq, dtype=np.int32).reshape(
            num_seqs, pages_per_seq
        )
        self.lengths = np.zeros(num_seqs, np.int32)  # tokens already in the cache
        max_tokens = num_seqs * pages_per_seq * page_size
        self.buckets = buckets_for_limits(max_tokens, num_seqs, pages_per_seq,
                                          token_paddings=pow2_buckets(1, max_tokens))

    @property
    def num_pages(self) -> int:
        return self.page_indices.size + 1  # and the null page

    @property
    def num_slots(self) -> int:
        """State slots a hybrid model's pool needs: one per sequence and the null slot."""
        return self.page_indices.shape[0] + 1

    def step_inputs(self, chunks: list[list[int]], logits: str = "last"):
        """Inputs for one forward over `chunks[i]` new tokens of sequence i (may be empty).

        `logits` is "last" (one row per sequence with new tokens) or "all" (every new token).
        Returns (input_ids, positions, metadata, logits_indices, rows) where `rows` names the
        (sequence, position) of each logits row.
        """
        seqs = [i for i, chunk in enumerate(chunks) if chunk]
        batch = make_forward_batch(
            [SeqChunk(chunks[i], int(self.lengths[i]), self.page_indices[i].tolist())
             for i in seqs], self.buckets, self.page_size)
        rows, logits_indices = [], []
        for i, start in zip(seqs, batch.cu_q_lens, strict=False):
            n = len(chunks[i])
            wanted = range(n) if logits == "all" else [n - 1]
            logits_indices += [int(start) + r for r in wanted]
            rows += [(i, int(self.lengths[i]) + r) for r in wanted]
            self.lengths[i] += n
        logits_indices += [0] * (_pow2(len(logits_indices)) - len(logits_indices))
        device = jax.device_put(batch)
        # Sequence i's state slot (a hybrid model's linear layers) is i + 1; padding's the null 0.
        state_slots = np.zeros(batch.shape[1], np.int32)
        state_slots[:len(seqs)] = np.asarray(seqs, np.int32) + 1
        metadata = dataclasses.replace(batch.host_metadata(), state_slots=state_slots)
        return (device.input_ids, device.positions, jax.device_put(metadata),
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
    dtype = model.final_norm.scale.get_value().dtype  # the model dtype (norms are never quantized)
    mesh = mesh or _mesh_of(model)
    kv_caches = init_kv_pool(config, batch.num_pages, page_size, dtype, mesh,
                             state_slots=batch.num_slots)
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
