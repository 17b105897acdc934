"""More LoRA adapters loaded than device slots (issue 73): the scheduler admits a request only
with its adapter in a slot, an adapter moves into the least recently used slot no running
request needs, a waiting adapter reserves a busy slot so that it is never starved, and a slot is
never rewritten under a running request (runtime/engine/adapter_slots.py). Driven by the
scheduler tests' fake model: no JAX, no device; the real slots: test_lora_engine.py."""
import random

import pytest

from tests.scheduler.fake_model import FakeModel, admission_order, make_scheduler, req
from xlaserve.runtime.engine.adapter_slots import AdapterSlots
from xlaserve.runtime.scheduler.request import AdapterRef


class SlotDevice(FakeModel):
    """The fake model with adapter slots: writes them as the LoRA hook does before each step,
    and checks that every row's slot still holds the adapter its request was admitted with."""

    def __init__(self, scheduler, slots):
        super().__init__(scheduler)
        self.slots = slots
        self.device = {s: k for s, k in enumerate(slots.keys) if k}  # slot -> adapter written
        self.bound = {}  # rid -> the slot it was admitted into

    def step(self, batch):
        for slot, key in self.slots.take_writes():
            self.device[slot] = key
        for r, slot in zip(batch.admitted, self.slots.device_ids(
                [r.adapter.key for r in batch.admitted])):
            self.bound[r.rid] = slot - 1
        for r in batch.requests:
            if r.adapter.key:
                assert self.device[self.bound[r.rid]] == r.adapter.key, r.rid
        tokens = super().step(batch)
        self.slots.new_turn(self.scheduler.waiting)  # the loop's between_steps
        return tokens


def lora_scheduler(num_slots=2, loaded=(1, 2), **kw):
    slots = AdapterSlots(num_slots)
    for key in loaded:
        slots.place(key)
    return make_scheduler(admission=slots, **kw), slots


def lora_req(rid, key, **kw):
    return req(rid, adapter=AdapterRef(key), **kw)


def both_slots_running(a_tokens: int, b_tokens: int):
    """Two slots holding adapters 1 and 2, each running one request ("a1", "b1") of this many
    tokens: (scheduler, slots, model)."""
    scheduler, slots = lora_scheduler()
    model = SlotDevice(scheduler, slots)
    scheduler.add(lora_req("a1", 1, max_new=a_tokens))
    scheduler.add(lora_req("b1", 2, max_new=b_tokens))
    model.run_step()
    return scheduler, slots, model


@pytest.mark.parametrize("overlapped", [False, True])
def test_random_traffic_over_four_adapters_and_two_slots_runs_in_the_right_slots(overlapped):
    """Every row's slot holds its adapter (SlotDevice), in the plain and the overlapped loop
    (the continuation admits while the last step runs)."""
    scheduler, slots = lora_scheduler(max_running=4, budget=24)
    rng = random.Random(0)
    model = SlotDevice(scheduler, slots)
    requests = [lora_req(f"r{i}", rng.choice([0, 1, 2, 3, 4]), max_new=rng.randint(1, 12),
                         prompt_len=rng.randint(2, 10)) for i in range(60)]
    for i, request in enumerate(requests):
        scheduler.add(request)
        if i % 3 == 0:
            model.run_step()
    model.run_overlapped() if overlapped else model.run_all()
    assert all(r.finish_reason[0] == "length" for r in requests)
    assert {r.rid for r in requests if r.adapter.key} <= model.bound.keys()
    assert slots.swaps >= 4


def test_an_adapter_waits_while_every_slot_runs_and_takes_the_first_that_empties():
    scheduler, slots, model = both_slots_running(20, 3)
    scheduler.add(lora_req("c", 3, max_new=2))
    while "c" not in admission_order(model):
        model.run_step()
        assert "c" in {r.rid for r in scheduler.waiting} or "c" in admission_order(model)
    # admitted once b1 ended, into its slot, though a's slot was the least recently used
    assert scheduler.requests.keys() == {"a1", "c"}
    assert model.bound["c"] == model.bound["b1"] and slots.swaps == 1
    model.run_all()


def test_a_slot_reserved_for_a_waiting_adapter_starts_no_new_request_of_its_own():
    scheduler, slots, model = both_slots_running(6, 10)
    scheduler.add(lora_req("c1", 3, max_new=2))  # reserves a's slot (used least recently)
    scheduler.add(lora_req("a2", 1, max_new=2))  # held back, a's slot being emptied for c1
    scheduler.add(lora_req("base", 0, max_new=2))  # the base model needs no slot
    scheduler.add(lora_req("b2", 2, max_new=2))  # its adapter's slot is not reserved: starts
    model.run_all()
    order = admission_order(model)
    assert order.index("base") < order.index("c1") and order.index("b2") < order.index("c1")
    assert order.index("c1") < order.index("a2")


def test_an_aborted_request_gives_back_the_slot_it_reserved():
    scheduler, slots, model = both_slots_running(30, 30)
    scheduler.add(lora_req("c1", 3))
    model.run_step()  # c1 reserves a's slot
    scheduler.add(lora_req("a2", 1, max_new=2))
    model.run_step()
    assert "a2" not in admission_order(model)
    scheduler.abort("c1")
    model.run_step()  # the turn's reservations are dropped once it ends (the loop's next turn)
    model.run_step()
    assert "a2" in admission_order(model) and slots.swaps == 0


def test_loads_fill_the_empty_slots_and_unloads_empty_them():
    slots = AdapterSlots(2)
    assert [slots.place(k) for k in (1, 2, 3)] == [0, 1, None]  # 3: host memory
    assert slots.release(3) is None and slots.release(1) == 0
    assert slots.keys == [0, 2] and slots.device_ids([0, 2]) == [0, 2]
    assert slots.place(4) == 0 and not slots.take_writes()  # the load writes its own slot
