"""The host-side scheduler, driven by a fake model (tests/scheduler/fake_model.py: no JAX, no
device). The overlapped loop's continuations: test_continuation.py."""
import logging

import pytest

from tests.scheduler.fake_model import FakeModel, admission_order, make_scheduler, req
from xlaserve.runtime.executor.buckets import max_step_tokens


def test_fcfs_order_within_equal_priority():
    s = make_scheduler(max_running=1)
    for rid in "abc":
        s.add(req(rid))
    model = FakeModel(s)
    model.run_all()
    assert admission_order(model) == ["a", "b", "c"]


def test_higher_priority_is_admitted_first_then_fcfs():
    s = make_scheduler(max_running=1)
    s.add(req("low1"))
    s.add(req("high", priority=5))
    s.add(req("low2"))
    s.add(req("mid", priority=1))
    model = FakeModel(s)
    model.run_all()
    assert admission_order(model) == ["high", "mid", "low1", "low2"]


def test_max_running_requests_is_respected():
    s = make_scheduler(max_running=2)
    for i in range(5):
        s.add(req(f"r{i}"))
    model = FakeModel(s)
    while s.has_work():
        model.run_step()
        assert s.num_running <= 2
    assert max(len(b.requests) for b in model.batches) == 2
    assert len({slot for b in model.batches for slot in b.slots}) == 2


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_running():
    s = make_scheduler(chunk=16, budget=64)
    s.add(req("short", prompt_len=4, max_new=20))
    model = FakeModel(s)
    model.run_step()  # short's prompt
    s.add(req("long", prompt_len=50, max_new=2))
    lengths, samples = [], []
    for _ in range(4):
        batch = s.schedule()
        assert batch.kind == "mixed"
        assert batch.requests[0].rid == "short" and batch.chunks[0].token_ids == [batch.requests[0].output_ids[-1]]
        assert batch.requests[1].rid == "long"  # decode rows first, then prefill rows
        lengths.append(len(batch.chunks[1].token_ids))
        samples.append(batch.chunks[1].sample)
        s.process_results(batch, model.step(batch))
    assert lengths == [16, 16, 16, 2]
    assert samples == [False, False, False, True]
    long = s.requests["long"]
    assert long.is_decoding and len(long.output_ids) == 1
    assert len(s.requests["short"].output_ids) == 5  # one token every step


def test_token_budget_caps_prompt_tokens_per_step_and_chunks_the_last_request():
    s = make_scheduler(chunk=16, budget=20)
    for rid in "abc":
        s.add(req(rid, prompt_len=12, max_new=3))
    model = FakeModel(s)
    batch = s.schedule()
    assert [(r.rid, len(c.token_ids), c.sample) for r, c in zip(batch.requests, batch.chunks, strict=True)] == [
        ("a", 12, True), ("b", 8, False)]
    s.process_results(batch, model.step(batch))
    batch = s.schedule()  # a decodes; b finishes its prompt; c gets what is left of the budget
    assert [(r.rid, len(c.token_ids)) for r, c in zip(batch.requests, batch.chunks, strict=True)] == [
        ("a", 1), ("b", 4), ("c", 12)]
    s.process_results(batch, model.step(batch))
    model.run_all()
    assert all(sum(len(c.token_ids) for r, c in zip(b.requests, b.chunks, strict=True) if not r.is_decoding) <= 20
               for b in model.batches)


def test_decodes_take_their_share_of_the_step_budget_and_prompts_keep_a_quarter():
    for decoding, prompt_tokens in [(8, 12), (18, 5)]:  # 20 - 8; a quarter of 20
        s = make_scheduler(num_pages=256, max_running=24, chunk=16, budget=20)
        for i in range(decoding):
            s.add(req(f"d{i}", prompt_len=1, max_new=50))
        model = FakeModel(s)
        model.run_step()  # every one-token prompt in one step; all of them decode from now on
        s.add(req("long", prompt_len=40, max_new=2))
        batch = s.schedule()
        assert [len(c.token_ids) for c in batch.chunks] == [1] * decoding + [prompt_tokens]
        assert batch.requests[-1].rid == "long"
    assert max_step_tokens(24, 20) == 24 + 5 and max_step_tokens(4, 20) == 20


def test_without_chunking_a_prompt_over_the_budget_runs_alone_in_one_step():
    s = make_scheduler(chunk=None, budget=20)
    s.add(req("small", prompt_len=5))
    s.add(req("big", prompt_len=30))
    model = FakeModel(s)
    first = s.schedule()
    assert [r.rid for r in first.requests] == ["small"]
    s.process_results(first, model.step(first))
    second = s.schedule()
    assert [(r.rid, len(c.token_ids), c.sample) for r, c in zip(second.requests, second.chunks, strict=True)] == [
        ("small", 1, True), ("big", 30, True)]


def test_pages_are_allocated_at_page_boundaries_and_never_leaked():
    s = make_scheduler(num_pages=16)
    s.add(req("a", prompt_len=6, max_new=8))
    model = FakeModel(s)
    pages_held = []
    while s.has_work():
        model.run_step()
        pages_held.append(s.num_pages_in_use)
    # kv after each step: 6 (prompt), then 7..13 for the decodes; the last step frees everything.
    assert pages_held == [2, 2, 2, 3, 3, 3, 3, 0]
    assert s.token_usage() == 0
    assert s.allocator.num_used == 3 == s.cache.evictable_pages  # 13 computed tokens: 3 whole pages
    assert s.flush_cache() == 3 and s.allocator.num_used == 0


def test_finishes_after_exactly_max_new_tokens():
    s = make_scheduler()
    s.add(req("a", max_new=7))
    s.add(req("b", max_new=1))
    finished = {r.rid: r for r in FakeModel(s).run_all()}
    assert len(finished["a"].output_ids) == 7 and len(finished["b"].output_ids) == 1
    assert finished["a"].finish_reason == ("length", None) and finished["a"].status == "finished"


def test_finishes_on_a_stop_id_but_not_before_min_new_tokens():
    s = make_scheduler()
    s.add(req("eager", max_new=10, stop_token_ids=frozenset({7})))
    patient = req("patient", max_new=10, stop_token_ids=frozenset({7, 8}), min_new_tokens=2)
    s.add(patient)
    script = {"eager": [1, 7, 2, 7, 3], "patient": [1, 7, 2, 7, 3]}
    assert s.suppressed_ids(patient) == [7, 8]
    finished = {r.rid: r for r in FakeModel(s, script).run_all()}
    assert finished["eager"].output_ids == [1, 7] and finished["eager"].finish_reason == ("stop", 7)
    assert finished["patient"].output_ids == [1, 7, 2, 7] and finished["patient"].finish_reason == ("stop", 7)
    assert s.suppressed_ids(patient) == []


class _Grammar:
    """A grammar stand-in: accepts once it has consumed `accepting_after` tokens."""

    def __init__(self, accepting_after: int):
        self.consumed, self.accepting_after = 0, accepting_after

    def consume(self, token: int) -> bool:
        self.consumed += 1
        return True

    def is_stopped(self) -> bool:
        return False

    def accepts(self) -> bool:
        return self.consumed >= self.accepting_after

    def dead_end(self) -> str:
        return "dead end"


def test_a_stop_id_before_the_grammar_accepts_fails_the_request_instead_of_stopping_it():
    """llguidance allows EOS where no token continues a grammar: such an output does not
    satisfy its constraint, so it ends as a failure with the grammar's message, never "stop"."""
    s = make_scheduler()
    s.add(req("early", max_new=10, stop_token_ids=frozenset({7}), grammar=_Grammar(3)))
    s.add(req("done", max_new=10, stop_token_ids=frozenset({7}), grammar=_Grammar(2)))
    script = {"early": [1, 7, 2], "done": [1, 2, 7]}
    finished = {r.rid: r for r in FakeModel(s, script).run_all()}
    assert finished["early"].finish_reason == ("abort", None)
    assert finished["early"].error == "dead end" and finished["early"].output_ids == [1, 7]
    assert finished["done"].finish_reason == ("stop", 7) and finished["done"].error is None


def test_abort_frees_pages_and_slot_at_once_in_every_state():
    s = make_scheduler(max_running=2, chunk=8)
    for rid, n in [("decoding", 6), ("prefilling", 30), ("waiting", 6)]:
        s.add(req(rid, prompt_len=n, max_new=50))
    model = FakeModel(s)
    model.run_step()
    model.run_step()
    assert s.requests["decoding"].is_decoding and s.requests["prefilling"].num_computed == 16
    assert s.requests["waiting"].status == "waiting"
    for rid in ["waiting", "prefilling", "decoding"]:
        used, free_slots = s.num_pages_in_use, len(s._free_slots)
        held = len(s.requests[rid].page_ids)
        aborted = s.abort(rid)
        assert aborted.finish_reason == ("abort", None) and aborted.status == "finished"
        assert aborted.page_ids == [] and aborted.slot is None and aborted.cache_node is None
        assert s.num_pages_in_use == used - held
        assert len(s._free_slots) == free_slots + (rid != "waiting")
    assert s.num_pages_in_use == 0 and not s.has_work() and s.schedule() is None
    # What they computed stays cached: prefilling's 16 prompt tokens, decoding's 6 (one whole page).
    assert s.cache.evictable_pages == 4 + 1
    assert s.abort("decoding") is None and s.abort("nobody") is None


def test_a_request_aborted_while_its_step_runs_is_not_advanced():
    s = make_scheduler()
    s.add(req("a"))
    batch = s.schedule()
    s.abort("a")
    assert s.process_results(batch, [5]) == []
    assert s.allocator.num_used == 0


@pytest.mark.parametrize("radix_cache", [True, False])
def test_a_pool_far_too_small_still_completes_everything_with_the_same_outputs(caplog, radix_cache):
    def run(num_pages):
        s = make_scheduler(num_pages=num_pages, max_running=8, chunk=8, budget=16, radix_cache=radix_cache)
        for i in range(10):
            s.add(req(f"r{i}", prompt_len=5 + 3 * i % 17, max_new=10 + 5 * i % 13, priority=int(i % 3 == 0)))
        model = FakeModel(s)
        outputs = {r.rid: (r.output_ids, r.finish_reason) for r in model.run_all()}
        assert s.num_pages_in_use == 0 and s.token_usage() == 0
        s.flush_cache()
        assert s.allocator.num_used == 0 and s.cache.num_pages == 0
        assert sorted(s._free_slots) == list(range(1, 9))
        return outputs, s

    expected, big = run(num_pages=200)
    with caplog.at_level(logging.INFO, logger="xlaserve.runtime.scheduler.scheduler"):
        got, tiny = run(num_pages=12)
    assert len(got) == 10 and got == expected
    assert "KV cache pool is full. Retract requests. #retracted_reqs:" in caplog.text
    assert all(len(out) == 10 + 5 * int(rid[1:]) % 13 for rid, (out, _) in got.items())


def test_retracted_requests_resume_first_with_their_output_kept():
    s = make_scheduler(num_pages=5, max_running=2, chunk=None)  # 4 usable pages = 16 tokens
    s.add(req("old", prompt_len=4, max_new=10))
    s.add(req("new", prompt_len=4, max_new=10))
    model = FakeModel(s)
    model.run_step()  # both prompts: a page each
    for _ in range(6):
        model.run_step()
    new = s.requests["new"]
    assert new.status == "waiting" and new.retracted_count == 1 and new.page_ids == [] and new.slot is None
    assert len(new.output_ids) > 1  # kept, to be recomputed as part of its prompt
    s.add(req("older", prompt_len=4, max_new=1, arrival_time=0.0))  # arrived first, never ran
    assert [r.rid for r in s.waiting] == ["new", "older"]  # the retracted one resumes first
    model.run_all()


def test_requests_that_can_never_fit_are_rejected_with_both_numbers():
    s = make_scheduler(num_pages=5, context=100)  # 4 usable pages of 4 tokens
    with pytest.raises(ValueError, match=r"is 101 tokens, more than the context length \(100\)"):
        s.add(req("a", prompt_len=90, max_new=11))
    with pytest.raises(ValueError, match=r"needs 5 KV pages \(17 tokens\) but the whole pool has 4 pages"):
        s.add(req("b", prompt_len=10, max_new=8))
    s.add(req("fits", prompt_len=10, max_new=7))  # 16 tokens in the cache at most
    assert s.num_waiting == 1
    FakeModel(s).run_all()


def test_slots_are_handed_out_and_reused():
    s = make_scheduler(max_running=2)
    for i in range(6):
        s.add(req(f"r{i}", max_new=2 + i))
    model = FakeModel(s)
    finished = model.run_all()
    assert {slot for b in model.batches for slot in b.slots} == {1, 2}
    assert all(r.slot is None for r in finished)
    assert sorted(s._free_slots) == [1, 2]


def test_prefill_and_decode_log_lines(caplog):
    s = make_scheduler(log_interval=3)
    s.add(req("a", max_new=10))
    with caplog.at_level(logging.INFO, logger="xlaserve.runtime.scheduler.scheduler"):
        FakeModel(s).run_all()
    assert ("Prefill batch. #new-seq: 1, #new-token: 6, #cached-token: 0, token usage: 0.03, "
            "#running-req: 0, #queue-req: 0") in caplog.text
    decode_lines = [m for m in caplog.messages if m.startswith("Decode batch.")]
    assert len(decode_lines) == 3  # 9 decode steps, one line per 3
    assert "#running-req: 1, #token: " in decode_lines[0] and "gen throughput (token/s): " in decode_lines[0]


def test_prefills_stuck_without_pages_retract_the_newest_so_the_oldest_finishes(caplog):
    s = make_scheduler(num_pages=5, chunk=4, budget=8)  # 4 usable pages; each prompt needs 3
    s.add(req("a", prompt_len=12, max_new=1))
    s.add(req("b", prompt_len=12, max_new=1))
    model = FakeModel(s)
    model.run_step()
    model.run_step()  # a and b hold two pages each: neither prompt can go on
    with caplog.at_level(logging.INFO, logger="xlaserve.runtime.scheduler.scheduler"):
        batch = s.schedule()
    assert [r.rid for r in batch.requests] == ["a"] and s.requests["b"].retracted_count == 1
    assert "KV cache pool is full. Retract requests. #retracted_reqs: 1" in caplog.text
    finished = s.process_results(batch, model.step(batch)) + model.run_all()
    assert [r.rid for r in finished] == ["a", "b"] and s.num_pages_in_use == 0
