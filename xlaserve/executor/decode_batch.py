"""The ForwardBatch of a continuation whose rows all decode (scheduler/request.py, DecodeRows),
built from its columns, with the page table kept from one such step to the next.

make_forward_batch reads every SeqChunk (its token ids, its page list) into fresh arrays. A
run of decode steps over the same requests changes little from one step to the next: every row's
KV grows by one token, a row in page_size gets a page, and rows end. So the page table of the
last decode step is kept and only its changed rows are written (`DecodeRows.kept` / `changed`);
the other columns are one array each. The arrays equal make_forward_batch's for the same
chunks (tests/executor/test_decode_batch.py).
"""
from __future__ import annotations

import itertools

import numpy as np

from xlaserve.executor.buckets import Buckets
from xlaserve.executor.forward_batch import ForwardBatch
from xlaserve.model.transformer import AttentionMetadata
from xlaserve.scheduler.page_allocator import NULL_PAGE
from xlaserve.scheduler.request import DecodeRows


class DecodeBatches:
    """Builds decode steps' ForwardBatches, keeping the last one's padded page table, which the
    next one updates in place (the engine thread's: one per EngineCore). The table is as wide as
    the context's pages (buckets.serving_buckets: one width), 8192 at Llama-3.1-8B's 128K
    tokens and page size 16, i.e. 8 MB at 256 rows: filling it afresh each step cost ~1 ms of
    host time (benchmarks/bench_host_step.py at that context). The step's vectors copy it
    (`step_vectors`), so the next step may write it."""

    def __init__(self, buckets: Buckets, page_size: int):
        self.buckets = buckets
        self.page_size = page_size
        self._rows: DecodeRows | None = None  # the rows `_page_indices` holds
        self._page_indices: np.ndarray | None = None  # i32[padded seqs, padded pages]

    def forward_batch(self, rows: DecodeRows) -> ForwardBatch:
        n = len(rows.num_cached)
        num_cached = np.array(rows.num_cached, np.int32)
        kv = num_cached + 1
        pages_needed = -(-kv // self.page_size)
        num_pages = np.fromiter(map(len, rows.page_ids), np.int64, n)
        if (short := np.flatnonzero(num_pages < pages_needed)).size:
            i = int(short[0])
            raise ValueError(f"sequence {i} needs {pages_needed[i]} pages, has {num_pages[i]}")
        padded_tokens, padded_seqs, padded_pages = self.buckets.shape_for(
            n, n, int(pages_needed.max()))
        positions = np.zeros(padded_tokens, np.int32)
        positions[:n] = num_cached
        kv_lens = np.zeros(padded_seqs, np.int32)
        kv_lens[:n] = kv
        page_indices = self._updated_page_indices(rows, (padded_seqs, padded_pages))
        row_index = np.arange(padded_seqs, dtype=np.int32)
        cu_q_lens = np.minimum(np.arange(padded_seqs + 1, dtype=np.int32), n)
        sample_rows = row_index < n
        input_slots = np.full(padded_tokens, -1, np.int32)
        input_slots[:n] = rows.slots
        metadata = AttentionMetadata(kv_lens=kv_lens, page_indices=page_indices,
                                     cu_q_lens=cu_q_lens, num_seqs=np.array([n], np.int32))
        return ForwardBatch(
            input_ids=np.zeros(padded_tokens, np.int32), positions=positions, metadata=metadata,
            logits_indices=np.where(sample_rows, row_index, 0).astype(np.int32),
            sample_rows=sample_rows, target_ids=np.full(padded_tokens, -1, np.int32),
            input_slots=input_slots)

    def _updated_page_indices(self, rows: DecodeRows, shape: tuple[int, int]) -> np.ndarray:
        """The page table of `rows` padded to `shape` (NULL_PAGE past each row's pages and in
        the padding rows): the last step's, less the rows that left, with the changed rows'
        pages written; built whole when the last step was not this one's parent or its shape
        differs. A decode row's page list only grows (a swap for cached pages keeps its
        length), so a row rewritten in place has NULL_PAGE after its pages already."""
        n, last = len(rows.page_ids), self._rows
        page_indices = self._page_indices
        if (page_indices is None or page_indices.shape != shape or last is None
                or rows.parent is not last):
            page_indices = np.full(shape, NULL_PAGE, np.int32)
            _write_rows(page_indices, rows.page_ids)
        else:
            if rows.kept is not None:
                page_indices[:n] = page_indices[rows.kept]
                page_indices[n:len(last.page_ids)] = NULL_PAGE
            for i in rows.changed:
                pages = rows.page_ids[i]
                page_indices[i, :len(pages)] = pages
        self._rows, self._page_indices = rows, page_indices
        return page_indices


def _write_rows(table: np.ndarray, page_ids: list[list[int]]) -> None:
    """Row i of `table` starts with page_ids[i]; one scatter (a row at a time cost ~0.2 ms at
    256 rows)."""
    lengths = np.fromiter(map(len, page_ids), np.int64, len(page_ids))
    starts = np.cumsum(lengths) - lengths
    rows = np.repeat(np.arange(len(page_ids)), lengths)
    table[rows, np.arange(rows.size) - np.repeat(starts, lengths)] = np.fromiter(
        itertools.chain.from_iterable(page_ids), np.int32, rows.size)
