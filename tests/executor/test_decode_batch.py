"""Decode steps' ForwardBatches built from the scheduler's columns (decode_forward_batch, runtime/executor/forward_batch.py):
the same arrays and page lists as make_forward_batch over the steps' SeqChunks, through rows
that end, rows that get pages and whole pages swapped for cached ones."""
import jax
import numpy as np

from tests.scheduler.fake_model import PAGE, FakeModel, make_scheduler, req
from xlaserve.runtime.executor.buckets import buckets_for_limits
from xlaserve.runtime.executor.forward_batch import decode_forward_batch
from xlaserve.runtime.executor.forward_batch import make_forward_batch

BUCKETS = buckets_for_limits(max_tokens_per_step=64, max_seqs=8, max_pages_per_seq=16,
                             seq_paddings=[1, 2, 4, 8])


class CheckedModel(FakeModel):
    """FakeModel that also builds each decode step's ForwardBatch both ways."""

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.compared = 0

    def step(self, batch):
        if batch.decode is not None:
            fast = decode_forward_batch(batch.decode, BUCKETS, PAGE)
            chunks = list(batch.chunks)
            # The columns say what each request's state says (the page lists it holds now).
            assert [c.page_ids for c in chunks] == [r.page_ids for r in batch.requests]
            assert [c.input_slot for c in chunks] == [r.slot for r in batch.requests]
            reference = make_forward_batch(chunks, BUCKETS, PAGE)
            for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(reference), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a, b)
            assert fast.shape == reference.shape and fast.page_ids == reference.page_ids
            self.compared += 1
        return super().step(batch)


def test_decode_steps_from_columns_equal_make_forward_batch_over_their_chunks():
    # "ab", "ba" and "ab2", "2ba" have the same prompts (ids from the sum of the id's
    # characters) and so the same outputs (FakeModel's tokens depend on the ids alone): the later
    # of a pair completes whole output pages that the prefix cache already holds from the
    # earlier, and its page list changes under it. Outputs of different lengths end rows in the
    # middle of runs; 6 slots for 9 requests admit late ones.
    s = make_scheduler(num_pages=96, max_running=6, chunk=8)
    for i, rid in enumerate(["ab", "ba", "c", "d", "ab2", "2ba", "e", "f", "g"]):
        s.add(req(rid, prompt_len=5 + i // 2 * 4, max_new=18 - i))
    swaps = []
    share = s.prefix.share_computed_pages

    def share_and_note(request):
        before = list(request.page_ids)
        share(request)
        swaps.append(request.page_ids != before)
    s.prefix.share_computed_pages = share_and_note
    model = CheckedModel(s)
    finished = model.run_overlapped()
    assert len(finished) == 9 and s.num_pages_in_use == 0
    assert model.compared > 10 and any(swaps)
    # Runs of decode steps continued the last one's columns, with rows that left.
    assert any(b.decode is not None and b.decode.kept is not None for b in model.batches)
    assert any(_grew(b.decode) for b in model.batches)


def _grew(rows) -> bool:
    """A decode continuation in which a row has a page its row in the parent had not."""
    if rows is None or rows.parent is None:
        return False
    parent = rows.parent.page_ids
    before = parent if rows.kept is None else [parent[i] for i in rows.kept]
    return any(len(p) > len(q) for p, q in zip(rows.page_ids, before, strict=True))
