"""The scheduler's test driver: a scheduler with small numbers, requests whose prompts depend on
their id, and `FakeModel`, which runs the scheduled batches on the host (no JAX, no device)."""
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.scheduler.page_allocator import PageAllocator, pages_for_tokens
from xlaserve.runtime.scheduler.request import Request
from xlaserve.runtime.scheduler.scheduler import Scheduler


PAGE = 4


def make_scheduler(num_pages=64, max_running=8, chunk=16, budget=64, context=256, **kw):
    return Scheduler(PageAllocator(num_pages), PAGE, max_running, chunk, budget, context, **kw)


def req(rid, prompt_len=6, max_new=4, prompt=None, **kw):
    """A request whose prompt is `prompt`, or `prompt_len` ids 60..99 that depend on `rid`."""
    if prompt is None:
        prompt = [(sum(map(ord, rid)) + i) % 40 + 60 for i in range(prompt_len)]
    kw.setdefault("sampling", RowSamplingParams())
    return Request(rid=rid, prompt_ids=prompt, max_new_tokens=max_new, **kw)


class FakeModel:
    """Writes each chunk's tokens into its pages and computes the next token from what it reads
    back through the page table, so a missing, stale or shared page changes the output. Tokens
    depend only on the request's own ids (or on `script`), never on the rest of the batch."""

    def __init__(self, scheduler, script=None):
        self.scheduler = scheduler
        self.pages: dict[int, list] = {}
        self.script = script or {}
        self.batches = []
        self.last_tokens: dict[int, int] = {}  # per slot, like the device's

    def step(self, batch):
        """Runs `batch` at once, as the device would when it was dispatched: a continuation
        row (input_slot >= 0, ScheduledBatch.row_ahead) reads its input token from the slot, not
        from the request."""
        self.batches.append(batch)
        assert len(set(batch.slots)) == len(batch.slots)
        assert all(1 <= s <= self.scheduler.max_running_requests for s in batch.slots)
        tokens = []
        for request, chunk, ahead in zip(batch.requests, batch.chunks, batch.row_ahead(),
                                         strict=True):
            kv_len = chunk.num_cached + len(chunk.token_ids)
            assert len(chunk.page_ids) == pages_for_tokens(kv_len, PAGE)  # covers it, exactly
            token_ids = chunk.token_ids
            if chunk.input_slot >= 0:
                token_ids = [self.last_tokens[chunk.input_slot]]
            for i, token in enumerate(token_ids):
                pos = chunk.num_cached + i
                self.pages.setdefault(chunk.page_ids[pos // PAGE], [None] * PAGE)[pos % PAGE] = token
            seen = [self.pages[chunk.page_ids[p // PAGE]][p % PAGE] for p in range(kv_len)]
            unread = token_ids if ahead else []  # sampled by the step still unprocessed
            if chunk.num_drafts:  # a verified row: a token after each of its tokens
                assert not ahead and seen == request.all_ids() + token_ids[1:]
                tokens += [self._next(request, seen[:chunk.num_cached + 1 + j], j)
                           for j in range(len(token_ids))]
                continue
            assert seen == (request.all_ids() + unread)[:kv_len]
            if request.rid in self.script:
                tokens.append(self.script[request.rid][len(request.output_ids) + ahead])
            else:
                tokens.append(sum((i + 1) * t for i, t in enumerate(seen)) % 50 + 10)
            if chunk.sample:
                self.last_tokens[request.slot] = tokens[-1]
        return tokens

    def _next(self, request, seen, ahead):
        """The token after `seen` (a request's ids and drafts): as a plain step computes it."""
        if request.rid in self.script:
            return self.script[request.rid][len(request.output_ids) + ahead]
        return sum((i + 1) * t for i, t in enumerate(seen)) % 50 + 10

    def run_overlapped(self, max_steps=10_000):
        """The engine's loop: the continuation of the step in flight is dispatched before that
        step's results are processed; otherwise the next step is scheduled after them."""
        finished, in_flight = [], None
        for _ in range(max_steps):
            if not self.scheduler.has_work() and in_flight is None:
                return finished
            following = None
            if in_flight is not None:
                batch = self.scheduler.schedule_continuation(in_flight[0])
                following = (batch, self.step(batch)) if batch is not None else None
                finished += self.scheduler.process_results(*in_flight)
            in_flight = following
            if in_flight is None and (batch := self.scheduler.schedule()) is not None:
                in_flight = (batch, self.step(batch))
        raise AssertionError("the scheduler did not finish its work")

    def run_step(self):
        batch = self.scheduler.schedule()
        assert batch is not None
        return self.scheduler.process_results(batch, self.step(batch))

    def run_all(self, max_steps=10_000):
        finished = []
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return finished
            finished += self.run_step()
        raise AssertionError("the scheduler did not finish its work")


def admission_order(model):
    return [r.rid for b in model.batches for r in b.admitted]


def outputs(finished):
    return {r.rid: (r.output_ids, r.finish_reason) for r in finished}
