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
import itertools

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
    """`chunks` concatenated into host arrays padded to the smallest fitting bucket.

    Column-wise: each per-sequence field is read into one array and the token rows and page
    table are filled by whole-array assignments. The row-by-row loop (a dozen small numpy
    assignments per sequence) cost 0.58 ms of the engine thread's time per 256-row decode step
    on a 2-core CPU (benchmarks/bench_host_step.py), this ~0.15 ms."""
    n = len(chunks)
    lengths = np.fromiter((len(c.token_ids) for c in chunks), np.int64, n)
    if n == 0 or not lengths.all():
        raise ValueError("a scheduled sequence must run at least one token")
    num_cached = np.fromiter((c.num_cached for c in chunks), np.int64, n)
    kv = num_cached + lengths
    pages_needed = -(-kv // page_size)
    has_pages = np.fromiter((len(c.page_ids) for c in chunks), np.int64, n)
    if (short := np.flatnonzero(has_pages < pages_needed)).size:
        i = int(short[0])
        raise ValueError(f"sequence {i} needs {pages_needed[i]} pages, has {has_pages[i]}")
    ends = np.cumsum(lengths)
    starts = ends - lengths
    num_tokens = int(ends[-1])
    padded_tokens, padded_seqs, padded_pages = buckets.shape_for(num_tokens, n,
                                                                 int(pages_needed.max()))

    input_ids = np.zeros(padded_tokens, np.int32)
    positions = np.zeros(padded_tokens, np.int32)
    kv_lens = np.zeros(padded_seqs, np.int32)
    page_indices = np.full((padded_seqs, padded_pages), NULL_PAGE, np.int32)
    cu_q_lens = np.full(padded_seqs + 1, num_tokens, np.int32)
    logits_indices = np.zeros(padded_seqs, np.int32)
    sample_rows = np.zeros(padded_seqs, np.bool_)
    target_ids = np.full(padded_tokens, -1, np.int32)
    input_slots = np.full(padded_tokens, -1, np.int32)
    input_ids[:num_tokens] = np.fromiter(
        itertools.chain.from_iterable(c.token_ids for c in chunks), np.int32, num_tokens)
    # Token row t of sequence i is at position num_cached[i] + (t - starts[i]).
    positions[:num_tokens] = np.arange(num_tokens) + np.repeat(num_cached - starts, lengths)
    kv_lens[:n] = kv
    cu_q_lens[:n] = starts
    logits_indices[:n] = ends - 1
    sample_rows[:n] = np.fromiter((c.sample for c in chunks), np.bool_, n)
    slots = np.fromiter((c.input_slot for c in chunks), np.int64, n)
    from_slot = slots >= 0
    if (wrong := np.flatnonzero(from_slot & (lengths != 1))).size:
        i = int(wrong[0])
        raise ValueError(f"sequence {i} takes its input from a slot but runs {lengths[i]} tokens")
    input_slots[starts[from_slot]] = slots[from_slot]
    for i, chunk in enumerate(chunks):  # prompt-logprob chunks only: rare
        if chunk.target_ids is not None:
            if len(chunk.target_ids) != lengths[i]:
                raise ValueError(f"sequence {i} has {lengths[i]} tokens but "
                                 f"{len(chunk.target_ids)} targets")
            target_ids[starts[i]:ends[i]] = chunk.target_ids
    # The page table: sequence i's first pages_needed[i] pages, in one scatter.
    total_pages = int(pages_needed.sum())
    table_rows = np.repeat(np.arange(n), pages_needed)
    table_cols = np.arange(total_pages) - np.repeat(np.cumsum(pages_needed) - pages_needed,
                                                    pages_needed)
    page_indices[table_rows, table_cols] = np.fromiter(
        itertools.chain.from_iterable(c.page_ids[:p] for c, p in zip(chunks, pages_needed.tolist())),
        np.int32, total_pages)
    metadata = AttentionMetadata(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
                                 num_seqs=np.array([n], np.int32))
    return ForwardBatch(input_ids, positions, metadata, logits_indices, sample_rows, target_ids,
                        input_slots)
