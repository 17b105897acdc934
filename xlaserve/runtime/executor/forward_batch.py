"""ForwardBatch: one step's model inputs, concatenated and padded to a bucket on the host, then
sent to the device in one transfer.

Each scheduled sequence contributes a chunk of new tokens (a whole prompt, a piece of a chunked
prefill, or one decode token). Chunks are concatenated into one ragged token array; `cu_q_lens`
and `kv_lens` say which tokens belong to whom (docs/architecture.md, the kernel contract).
Padding tokens and padding sequences are dead: `num_seqs` and `cu_q_lens` exclude them.

The page table is not one of the arrays: each live sequence's page list (`page_ids`) stays on the
host, and the serving step gathers its rows from the device's table by slot, which ModelRunner
keeps written (runtime/executor/page_table.py). `host_metadata` builds the padded table on the host, for
drivers that call the model directly (greedy.py, tests).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import numpy as np

from xlaserve.model.transformer import AttentionMetadata
from xlaserve.runtime.executor.buckets import Buckets
from xlaserve.runtime.scheduler.page_allocator import NULL_PAGE
from xlaserve.runtime.scheduler.request import SeqChunk

_ARRAYS = ("input_ids", "positions", "kv_lens", "cu_q_lens", "num_seqs", "logits_indices",
           "sample_rows", "target_ids", "input_slots")


@functools.partial(jax.tree_util.register_dataclass, data_fields=_ARRAYS,
                   meta_fields=("pages",), drop_fields=("page_ids",))
@dataclasses.dataclass
class ForwardBatch:
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    kv_lens: np.ndarray  # i32[S]: each sequence's KV length, its new tokens included
    cu_q_lens: np.ndarray  # i32[S+1]: where each sequence's tokens start
    num_seqs: np.ndarray  # i32[1]: the live sequences
    logits_indices: np.ndarray  # i32[S]: the last new token of each sequence
    sample_rows: np.ndarray  # bool[S]: rows whose sampled token is kept (and counted)
    # i32[T]: per token row, the id whose logprob and top alternatives the step returns, -1 for
    # none (padding too). Data, not a static argument: any mix runs in the bucket's one program.
    target_ids: np.ndarray
    # i32[T]: per token row, the slot whose last sampled token (device state) is the input, -1
    # where `input_ids` holds it.
    input_slots: np.ndarray
    pages: int  # pages per sequence: the width of the page table the attention reads
    # Each live sequence's pages (host only, not a pytree leaf: ModelRunner writes them into the
    # device's page table). Lists the batch does not own: read, never changed.
    page_ids: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tokens, seqs, pages per seq): the bucket, i.e. which compiled program runs it."""
        return self.input_ids.shape[0], self.logits_indices.shape[0], self.pages

    def host_metadata(self) -> AttentionMetadata:
        """The attention's metadata with the page table built on the host: sequence i's pages,
        then NULL_PAGE, and NULL_PAGE rows for padding."""
        page_indices = np.full((self.shape[1], self.pages), NULL_PAGE, np.int32)
        write_rows(page_indices, self.page_ids)
        return AttentionMetadata(kv_lens=self.kv_lens, page_indices=page_indices,
                                 cu_q_lens=self.cu_q_lens, num_seqs=self.num_seqs)


def write_rows(table: np.ndarray, page_ids: list[list[int]]) -> None:
    """Row i of `table` starts with page_ids[i] (cut to the table's width); one scatter."""
    lengths = np.fromiter((min(len(p), table.shape[1]) for p in page_ids), np.int64, len(page_ids))
    starts = np.cumsum(lengths) - lengths
    rows = np.repeat(np.arange(len(page_ids)), lengths)
    table[rows, np.arange(rows.size) - np.repeat(starts, lengths)] = np.fromiter(
        itertools.chain.from_iterable(p[:n] for p, n in zip(page_ids, lengths.tolist())),
        np.int32, rows.size)


def make_forward_batch(chunks: list[SeqChunk], buckets: Buckets, page_size: int) -> ForwardBatch:
    """`chunks` concatenated into host arrays padded to the smallest fitting bucket.

    Column-wise: each per-sequence field is read into one array and the token rows are filled
    by whole-array assignments. The row-by-row loop (a dozen small numpy
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
    return ForwardBatch(input_ids, positions, kv_lens, cu_q_lens, np.array([n], np.int32),
                        logits_indices, sample_rows, target_ids, input_slots, padded_pages,
                        [c.page_ids for c in chunks])
