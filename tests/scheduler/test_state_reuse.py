"""A hybrid model's prefix cache (scheduler/state_reuse.py) through the scheduler with a fake model
whose every state-pool slot holds the tokens its linear layers have read: each chunk must find in
its request's slot exactly the tokens before it (from zeros at a prompt's start, or restored from
a snapshot), so a missing, stale or misplaced restore or snapshot fails, with the steps in turn
and overlapped; an answer snapshotted at its last whole page as it decodes, each replacing the
one before, where the chat's next turn starts."""
import functools

from tests.scheduler.fake_model import PAGE, FakeModel, make_scheduler, outputs, req
from xlaserve.runtime.scheduler.state_reuse import STATE_COPIES, StatePrefixReuse

MAX_RUNNING = 12
SNAPSHOTS = 4


def state_scheduler(**kw):
    slots = range(MAX_RUNNING + 1, MAX_RUNNING + 1 + SNAPSHOTS)
    return make_scheduler(max_running=MAX_RUNNING, num_pages=256, prefix_reuse=functools.partial(
        StatePrefixReuse, snapshot_slots=slots), **kw)


class StateModel(FakeModel):
    """FakeModel, and per state slot the tokens read into it (the linear layers' state)."""

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.states: dict[int, tuple] = {}

    def step(self, batch):
        for chunk in batch.chunks:  # the step's restores come first
            if chunk.restore is not None:
                source, target = chunk.restore
                self.states[target] = self.states[source]
        tokens = super().step(batch)
        for request, chunk in zip(batch.requests, batch.chunks, strict=True):
            kv_len = chunk.num_cached + len(chunk.token_ids)
            seen = tuple(self.pages[chunk.page_ids[p // PAGE]][p % PAGE] for p in range(kv_len))
            before = () if chunk.num_cached == 0 else self.states.get(request.slot)
            assert before == seen[:chunk.num_cached], (request.rid, chunk.num_cached)
            self.states[request.slot] = seen
        for chunk in batch.chunks:  # and its snapshots last
            if chunk.snapshot is not None:
                source, target = chunk.snapshot
                self.states[target] = self.states[source]
        return tokens


def test_a_prompt_sharing_a_snapshotted_prefix_restores_it_and_starts_there():
    scheduler = state_scheduler()
    model = StateModel(scheduler)
    system = list(range(60, 70))  # snapshotted at 8 (its last whole page before its end)
    scheduler.add(req("a", prompt=system, max_new=3))
    model.run_all()
    scheduler.add(req("b", prompt=system + [80, 81, 82], max_new=3))
    batch = scheduler.schedule()
    (chunk,) = batch.chunks
    assert chunk.num_cached == 8 and chunk.restore is not None
    assert chunk.restore[1] == batch.requests[0].slot and chunk.restore[0] > MAX_RUNNING
    scheduler.process_results(batch, model.step(batch))
    model.run_all()


def test_a_step_restores_at_most_its_copies_and_the_rest_start_next_step():
    scheduler = state_scheduler()
    model = StateModel(scheduler)
    system = list(range(60, 69))
    scheduler.add(req("first", prompt=system, max_new=2))
    model.run_all()
    for i in range(STATE_COPIES + 3):
        scheduler.add(req(f"r{i}", prompt=system + [70 + i], max_new=2))
    restores = []
    while scheduler.has_work():
        batch = scheduler.schedule()
        restores.append(sum(c.restore is not None for c in batch.chunks))
        scheduler.process_results(batch, model.step(batch))
    assert restores[:2] == [STATE_COPIES, 3]


def test_a_chats_next_turn_starts_at_its_answers_last_whole_page():
    """A 7-token prompt (snapshotted at 4) answered with 12 tokens, decoded in turn and then
    overlapped: its decode rows snapshot at 8, 12 and 16 (18 tokens computed when it ends), each
    replacing the one before; the next turn, prompt + answer + 2 tokens, restores the one at 16."""
    for overlapped in (False, True):
        scheduler = state_scheduler()
        model = StateModel(scheduler)
        prompt = list(range(60, 67))
        scheduler.add(req("a", prompt=prompt, max_new=12))
        answer = outputs(model.run_overlapped() if overlapped else model.run_all())["a"][0]
        held = sorted(node.prefix_pages * PAGE for node in scheduler.prefix.snapshots.holders)
        assert held == [4, 16], overlapped
        scheduler.add(req("b", prompt=prompt + answer + [61, 62], max_new=2))
        batch = scheduler.schedule()
        assert batch.chunks[0].num_cached == 16 and batch.chunks[0].restore is not None
        scheduler.process_results(batch, model.step(batch))
        model.run_all()


def test_overlapped_turns_and_evicted_snapshots_keep_every_state_exact():
    """Chats of three turns each, interleaved, on fewer snapshot slots than chats, the
    continuation of each step dispatched before its results: every chunk's state checked."""
    scheduler = state_scheduler(chunk=5)
    model = StateModel(scheduler)
    prompts = {f"chat{c}": [(13 * c + i) % 40 + 60 for i in range(7 + c)] for c in range(6)}
    for turn in range(3):
        for rid, prompt in prompts.items():
            scheduler.add(req(f"{rid}.{turn}", prompt=prompt, max_new=4))
        finished = outputs(model.run_overlapped())
        for rid in prompts:
            prompts[rid] = prompts[rid] + finished[f"{rid}.{turn}"][0] + [61, 62]
    cached = [r.num_cached_prompt_tokens for b in model.batches for r in b.admitted]
    assert any(cached) and len(scheduler.prefix.snapshots.holders) == SNAPSHOTS
