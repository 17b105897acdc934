"""The overlapped loop's continuations: a step scheduled from the one in flight, before its tokens
are read (Scheduler.schedule_continuation), and the same outputs as the plain loop."""
import pytest

from tests.scheduler.fake_model import PAGE, FakeModel, make_scheduler, outputs, req
from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens
from xlaserve.runtime.scheduler.request import ScheduledBatch


@pytest.mark.parametrize("num_pages", [64, 9])  # 9: retractions
def test_overlapped_loop_gives_the_same_outputs_and_frees_every_page(num_pages):
    def run(overlapped):
        s = make_scheduler(num_pages=num_pages, max_running=4, chunk=5)
        for i, rid in enumerate("abcdef"):
            s.add(req(rid, prompt_len=3 + 2 * i, max_new=1 + 3 * i))
        model = FakeModel(s)
        finished = model.run_overlapped() if overlapped else model.run_all()
        assert s.num_pages_in_use == 0 and not s.has_work()
        assert any(r.retracted_count for r in finished) == (num_pages == 9)
        return outputs(finished), model

    (plain, _), (overlapped, model) = run(False), run(True)
    assert overlapped == plain
    assert any(b.ahead for b in model.batches)  # continuations did run


def test_a_continuation_runs_every_sampling_request_one_token_further():
    s = make_scheduler()
    s.add(req("a", prompt_len=6, max_new=8))
    s.add(req("b", prompt_len=3, max_new=8))
    model = FakeModel(s)
    first = s.schedule()  # both prompts whole: both sample
    model.step(first)
    following = s.schedule_continuation(first)
    assert following.ahead == 1 and following.kind == "decode"
    assert [c.input_slot for c in following.chunks] == [r.slot for r in first.requests]
    assert [c.num_cached for c in following.chunks] == [6, 3]
    assert all(len(c.page_ids) == pages_for_tokens(c.num_cached + 1, PAGE) for c in following.chunks)


def test_a_continuation_admits_waiting_requests_but_not_beside_a_chunk_that_samples_nothing():
    s = make_scheduler(chunk=4)
    s.add(req("long", prompt_len=10))
    batch = s.schedule()  # a 4-token chunk of 10: samples nothing
    assert s.schedule_continuation(batch) is None
    s = make_scheduler(max_running=2)
    model = FakeModel(s)
    s.add(req("a"))
    batch = s.schedule()
    tokens = model.step(batch)
    s.add(req("late", prompt_len=5))  # waiting, with a free slot: admitted beside a's decode
    following = s.schedule_continuation(batch)
    assert [r.rid for r in following.requests] == ["a", "late"] and following.kind == "mixed"
    assert [r.rid for r in following.admitted] == ["late"]
    assert [c.input_slot >= 0 for c in following.chunks] == [True, False]
    assert following.row_ahead() == [1, 0]  # late's first token is its output token 0
    assert following.chunks[1].token_ids == s.requests["late"].prompt_ids
    s.process_results(batch, tokens)
    s.add(req("later"))  # no free slot: it waits, and the decodes go on overlapped
    assert [r.rid for r in s.schedule_continuation(following).requests] == ["a", "late"]


def test_no_admission_in_a_continuation_while_a_running_request_is_left_out_of_it():
    s = make_scheduler(max_running=4)
    s.add(req("a"))
    s.add(req("b"))
    batch = s.schedule()
    # A step that left b out (as a prompt chunk beyond the budget is): b's next chunk is
    # scheduled with the results, and so are admissions.
    only_a = ScheduledBatch(batch.requests[:1], batch.chunks[:1], batch.slots[:1], "prefill")
    s.add(req("c"))
    assert s.schedule_continuation(only_a) is None
    assert [r.rid for r in s.schedule_continuation(batch).requests] == ["a", "b", "c"]


def test_a_continuation_leaves_out_requests_the_step_in_flight_ends_by_length():
    s = make_scheduler()
    s.add(req("one", max_new=1))
    s.add(req("more", max_new=5))
    batch = s.schedule()
    following = s.schedule_continuation(batch)
    assert [r.rid for r in following.requests] == ["more"]


def test_no_continuation_without_a_free_page_for_it():
    s = make_scheduler(num_pages=3)  # 2 pages (and the null page); each prompt fills one
    s.add(req("a", prompt_len=PAGE))
    s.add(req("b", prompt_len=PAGE))
    batch = s.schedule()
    assert s.schedule_continuation(batch) is None
    assert s.num_pages_in_use == 2


def test_the_continuation_row_of_a_request_a_stop_id_ended_is_dropped():
    s = make_scheduler()
    s.add(req("stops", max_new=10, stop_token_ids=frozenset({7})))
    s.add(req("goes_on", max_new=4))
    script = {"stops": [1, 7, 2, 2, 2, 2], "goes_on": [3, 4, 5, 6]}
    finished = outputs(FakeModel(s, script).run_overlapped())
    assert finished == {"stops": ([1, 7], ("stop", 7)), "goes_on": ([3, 4, 5, 6], ("length", None))}
    assert s.num_pages_in_use == 0
