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
    """Builds decode steps' ForwardBatches, keeping the last one's page table (the engine
    thread's: one per EngineCore)."""

    def __init__(self, buckets: Buckets, page_size: int):
        self.buckets = buckets
        self.page_size = page_size
        self._rows: DecodeRows | None = None  # the rows `_table` holds
        self._table = np.zeros((0, 0), np.int32)  # i32[rows, width]: page ids, NULL_PAGE after

    def forward_batch(self, rows: DecodeRows) -> ForwardBatch:
        n = len(rows.num_cached)
        table = self._page_table(rows)
        num_cached = np.array(rows.num_cached, np.int32)
        kv = num_cached + 1
        pages_needed = -(-kv // self.page_size)
        num_pages = (table != NULL_PAGE).sum(axis=1)
        if (short := np.flatnonzero(num_pages < pages_needed)).size:
            i = int(short[0])
            raise ValueError(f"sequence {i} needs {pages_needed[i]} pages, has {num_pages[i]}")
        padded_tokens, padded_seqs, padded_pages = self.buckets.shape_for(
            n, n, int(pages_needed.max()))
        positions = np.zeros(padded_tokens, np.int32)
        positions[:n] = num_cached
        kv_lens = np.zeros(padded_seqs, np.int32)
        kv_lens[:n] = kv
        # Each row's first pages_needed pages; a page past them (held, not yet written) is NULL
        # as in make_forward_batch.
        page_indices = np.full((padded_seqs, padded_pages), NULL_PAGE, np.int32)
        width = min(padded_pages, table.shape[1])
        page_indices[:n, :width] = np.where(
            np.arange(width) < pages_needed[:, None], table[:, :width], NULL_PAGE)
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

    def _page_table(self, rows: DecodeRows) -> np.ndarray:
        """Rows' page lists as a table: the last step's, less the rows that left, with the
        changed rows rewritten; built whole when the last step was not this one's parent."""
        if rows.parent is None or rows.parent is not self._rows:
            table = _whole_table(rows.page_ids)
        else:
            table = self._table if rows.kept is None else self._table[rows.kept]
            if rows.changed:
                width = max(len(rows.page_ids[i]) for i in rows.changed)
                if width > table.shape[1]:
                    table = np.pad(table, ((0, 0), (0, width - table.shape[1])),
                                   constant_values=NULL_PAGE)
                for i in rows.changed:
                    pages = rows.page_ids[i]
                    table[i, :len(pages)] = pages
                    table[i, len(pages):] = NULL_PAGE
        self._rows, self._table = rows, table
        return table


def _whole_table(page_ids: list[list[int]]) -> np.ndarray:
    """i32[rows, longest]: each row's pages, then NULL_PAGE; one scatter (a row at a time cost
    ~0.2 ms at 256 rows)."""
    lengths = np.fromiter(map(len, page_ids), np.int64, len(page_ids))
    table = np.full((len(page_ids), int(lengths.max(initial=0))), NULL_PAGE, np.int32)
    starts = np.cumsum(lengths) - lengths
    rows = np.repeat(np.arange(len(page_ids)), lengths)
    table[rows, np.arange(rows.size) - np.repeat(starts, lengths)] = np.fromiter(
        itertools.chain.from_iterable(page_ids), np.int32, rows.size)
    return table
