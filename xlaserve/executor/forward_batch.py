"""ForwardBatch: one step's model inputs, concatenated and padded to a bucket on the host, then
sent to the device in one transfer.

Each scheduled sequence contributes a chunk of new tokens (a whole prompt, a piece of a chunked
prefill, or one decode token). Chunks are concatenated into one ragged token array; `cu_q_lens`,
`kv_lens` and `page_indices` say which tokens belong to whom (docs/architecture.md, the kernel contract).
Padding tokens and padding sequences are dead: `num_seqs` and `cu_q_lens` exclude them, and their
page-table rows point at the null page.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from xlaserve.model.transformer import AttentionMetadata
from xlaserve.executor.buckets import Buckets
from xlaserve.scheduler.page_allocator import NULL_PAGE
from xlaserve.scheduler.request import SeqChunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    metadata: AttentionMetadata
    logits_indices: np.ndarray  # i32[S]: the last new token of each sequence
    sample_rows: np.ndarray  # bool[S]: rows whose sampled token is kept (and counted)
    # i32[T]: per token row, the id whose logprob and top alternatives the step returns, -1 for
    # none (padding too). Data, not a static argument: any mix runs in the bucket's one program.
    target_ids: np.ndarray
    # i32[T]: per token row, the slot whose last sampled token (device state) is the input, -1
    # where `input_ids` holds it.
    input_slots: np.ndarray

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tokens, seqs, pages per seq): the bucket, i.e. which compiled program runs it."""
        return (self.input_ids.shape[0], self.logits_indices.shape[0],
                self.metadata.page_indices.shape[1])


def make_forward_batch(chunks: list[SeqChunk], buckets: Buckets, page_size: int) -> ForwardBatch:
    """`chunks` concatenated into host arrays padded to the smallest fitting bucket."""
    num_tokens = sum(len(c.token_ids) for c in chunks)
    most_pages = max(-(-(c.num_cached + len(c.token_ids)) // page_size) for c in chunks)
    padded_tokens, padded_seqs, padded_pages = buckets.shape_for(num_tokens, len(chunks), most_pages)

    input_ids = np.zeros(padded_tokens, np.int32)
    positions = np.zeros(padded_tokens, np.int32)
    kv_lens = np.zeros(padded_seqs, np.int32)
    page_indices = np.full((padded_seqs, padded_pages), NULL_PAGE, np.int32)
    cu_q_lens = np.full(padded_seqs + 1, num_tokens, np.int32)
    logits_indices = np.zeros(padded_seqs, np.int32)
    sample_rows = np.zeros(padded_seqs, np.bool_)
    target_ids = np.full(padded_tokens, -1, np.int32)
    input_slots = np.full(padded_tokens, -1, np.int32)
    offset = 0
    for i, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError("a scheduled sequence must run at least one token")
        input_ids[offset:offset + n] = chunk.token_ids
        if chunk.input_slot >= 0:
            if n != 1:
                raise ValueError(f"sequence {i} takes its input from a slot but runs {n} tokens")
            input_slots[offset] = chunk.input_slot
        if chunk.target_ids is not None:
            if len(chunk.target_ids) != n:
                raise ValueError(f"sequence {i} has {n} tokens but {len(chunk.target_ids)} targets")
            target_ids[offset:offset + n] = chunk.target_ids
        positions[offset:offset + n] = np.arange(chunk.num_cached, chunk.num_cached + n)
        kv_lens[i] = chunk.num_cached + n
        pages_needed = -(-kv_lens[i] // page_size)
        if len(chunk.page_ids) < pages_needed:
            raise ValueError(f"sequence {i} needs {pages_needed} pages, has {len(chunk.page_ids)}")
        page_indices[i, :pages_needed] = chunk.page_ids[:pages_needed]
        cu_q_lens[i] = offset
        offset += n
        logits_indices[i] = offset - 1
        sample_rows[i] = chunk.sample
    metadata = AttentionMetadata(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
                                 num_seqs=np.array([len(chunks)], np.int32))
    return ForwardBatch(input_ids, positions, metadata, logits_indices, sample_rows, target_ids,
                        input_slots)
