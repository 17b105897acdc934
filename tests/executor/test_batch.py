"""Packing scheduled sequences into one padded ragged batch."""
import numpy as np
import pytest

from xlaserve.runtime.executor.buckets import buckets_for_limits
from xlaserve.runtime.executor.forward_batch import make_forward_batch

from xlaserve.runtime.scheduler.request import SeqChunk
from xlaserve.runtime.scheduler.page_allocator import NULL_PAGE

BUCKETS = buckets_for_limits(max_tokens_per_step=64, max_seqs=8, max_pages_per_seq=8,
                             seq_paddings=[1, 2, 4, 8])


def test_mixed_prefill_chunk_and_decodes_make_a_batch_to_the_contract():
    chunks = [
        SeqChunk(token_ids=[11, 12, 13], num_cached=5, page_ids=[7, 3], sample=False),  # mid-prompt
        SeqChunk(token_ids=[21], num_cached=9, page_ids=[2, 9, 4]),  # decode at position 9
        SeqChunk(token_ids=[31, 32], num_cached=0, page_ids=[5]),  # new prompt
    ]
    batch = make_forward_batch(chunks, BUCKETS, page_size=4)
    assert batch.shape == (8, 4, 4)  # 6 tokens -> 8, 3 seqs -> 4, 3 pages -> 4
    np.testing.assert_array_equal(batch.input_ids, [11, 12, 13, 21, 31, 32, 0, 0])
    np.testing.assert_array_equal(batch.positions[:6], [5, 6, 7, 9, 0, 1])
    assert batch.page_ids == [[7, 3], [2, 9, 4], [5]]
    md = batch.host_metadata()
    np.testing.assert_array_equal(md.cu_q_lens, [0, 3, 4, 6, 6])
    np.testing.assert_array_equal(md.kv_lens, [8, 10, 2, 0])
    np.testing.assert_array_equal(md.num_seqs, [3])
    np.testing.assert_array_equal(md.page_indices, [[7, 3, 0, 0], [2, 9, 4, 0], [5, 0, 0, 0], [0, 0, 0, 0]])
    assert (md.page_indices[3] == NULL_PAGE).all()
    np.testing.assert_array_equal(batch.logits_indices, [2, 3, 5, 0])
    np.testing.assert_array_equal(batch.sample_rows, [False, True, True, False])


def test_a_sequence_without_enough_pages_is_refused():
    with pytest.raises(ValueError, match="needs 2 pages, has 1"):
        make_forward_batch([SeqChunk(token_ids=[1, 2], num_cached=3, page_ids=[1])], BUCKETS,
                           page_size=4)


def test_an_empty_chunk_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        make_forward_batch([SeqChunk(token_ids=[], num_cached=3, page_ids=[1])], BUCKETS,
                           page_size=4)
