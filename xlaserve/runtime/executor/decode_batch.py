"""The ForwardBatch of a continuation whose rows all decode (runtime/scheduler/request.py, DecodeRows),
built from its columns.

make_forward_batch reads every SeqChunk (its token ids, its page list) into fresh arrays; a
decode continuation has its rows as columns already, one array each here. Its page lists are the
scheduler's, shared with the last decode step for the rows that got no page, which the device
page table's writes skip without reading them (runtime/executor/page_table.py). The arrays equal
make_forward_batch's for the same chunks (tests/executor/test_decode_batch.py).
"""
from __future__ import annotations

import numpy as np

from xlaserve.runtime.executor.buckets import Buckets
from xlaserve.runtime.executor.forward_batch import ForwardBatch
from xlaserve.runtime.scheduler.request import DecodeRows


def decode_forward_batch(rows: DecodeRows, buckets: Buckets, page_size: int) -> ForwardBatch:
    n = len(rows.num_cached)
    num_cached = np.array(rows.num_cached, np.int32)
    kv = num_cached + 1
    pages_needed = -(-kv // page_size)
    num_pages = np.fromiter(map(len, rows.page_ids), np.int64, n)
    if (short := np.flatnonzero(num_pages < pages_needed)).size:
        i = int(short[0])
        raise ValueError(f"sequence {i} needs {pages_needed[i]} pages, has {num_pages[i]}")
    padded_tokens, padded_seqs, padded_pages = buckets.shape_for(n, n, int(pages_needed.max()))
    positions = np.zeros(padded_tokens, np.int32)
    positions[:n] = num_cached
    kv_lens = np.zeros(padded_seqs, np.int32)
    kv_lens[:n] = kv
    row_index = np.arange(padded_seqs, dtype=np.int32)
    cu_q_lens = np.minimum(np.arange(padded_seqs + 1, dtype=np.int32), n)
    sample_rows = row_index < n
    input_slots = np.full(padded_tokens, -1, np.int32)
    input_slots[:n] = rows.slots
    return ForwardBatch(
        input_ids=np.zeros(padded_tokens, np.int32), positions=positions, kv_lens=kv_lens,
        cu_q_lens=cu_q_lens, num_seqs=np.array([n], np.int32),
        logits_indices=np.where(sample_rows, row_index, 0).astype(np.int32),
        sample_rows=sample_rows, target_ids=np.full(padded_tokens, -1, np.int32),
        input_slots=input_slots, pages=padded_pages, page_ids=rows.page_ids)
