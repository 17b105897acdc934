"""One bad request never touches another, in the engine: what a request could get wrong is refused
in `submit` (typed, in range, what the device columns hold), a failure tied to one request fails it
alone, a failed step fails its own rows only, the queue is bounded, and aborting many queued
requests takes time linear in their number."""
import queue
import threading
import time

import pytest

from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.runtime.engine import live_requests as live_requests_module
from xlaserve.runtime.engine.core import QueueFull
from xlaserve.runtime.engine.messages import OutputDelta
from xlaserve.runtime.scheduler.page_allocator import PageAllocator
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.sampling.params import InvalidSamplingParam, SamplingParams
from xlaserve.runtime.scheduler.scheduler import Scheduler
from xlaserve.runtime.scheduler.request import Request


SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=64, max_total_tokens=512)
LONG = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    make_tiny_checkpoint(directory, "llama")
    with Engine(directory, **SMALL) as engine:
        yield engine


def _finals(sinks: list[queue.Queue], timeout: float = 60) -> list[OutputDelta]:
    """Each request's final chunk (every submitted request must get one)."""
    finals = []
    for sink in sinks:
        chunk = sink.get(timeout=timeout)
        while not chunk.finished:
            chunk = sink.get(timeout=timeout)
        finals.append(chunk)
    return finals


def _submit(engine, prompt, params=LONG, **kwargs) -> queue.Queue:
    sink: queue.Queue = queue.Queue()
    engine.core.submit(prompt, params, sink.put, **kwargs)
    return sink


@pytest.mark.parametrize("field, value, message", [
    ("top_k", 2**31, "top_k must be -1 .off. or in \\[1, "),  # once overflowed the int32 column
    ("top_k", 0, "top_k must be -1"),
    ("stop", 5, "stop must be a string or a list of strings"),  # once a TypeError on the loop
    ("stop", ["a", 3], "stop must be a string or a list of strings"),
    ("seed", 2**64, "seed must be a 64-bit integer"),
    ("seed", 1.5, "seed must be an integer or null"),
    ("temperature", float("inf"), "temperature must be a finite number"),
    ("temperature", "hot", "temperature must be a number"),
    ("max_new_tokens", True, "max_new_tokens must be an integer"),
    ("logit_bias", {"x": 1.0}, "logit_bias must map token ids"),
    ("logit_bias", {3: float("nan")}, "logit_bias must map token ids"),
    ("logit_bias", {3: 1e9}, "logit_bias values must be in \\[-100, 100\\]"),
    ("stop_token_ids", [1.5], "stop_token_ids must be a list of token ids"),
    ("min_new_tokens", 50, "min_new_tokens must be in \\[0, max_new_tokens\\]"),
    ("regex", 7, "regex must be a string or null"),
    ("stop", ["x"] * 17, "at most 16 strings"),
    ("stop", ["x" * 257], "at most 256 characters"),
    ("regex", "a" * (256 * 1024 + 1), "longer than 262144 characters"),
])
def test_a_bad_value_is_refused_in_submit_naming_its_field(engine, field, value, message):
    params = SamplingParams(**{"max_new_tokens": 20, field: value})
    with pytest.raises(InvalidSamplingParam, match=message) as error:
        engine.core.submit([1, 2], params, lambda chunk: None)
    assert error.value.param == field


def test_bad_prompt_ids_and_n_are_refused_before_queueing(engine):
    with pytest.raises(InvalidSamplingParam, match="must be integers"):
        engine.core.submit([1, 2.5], LONG, lambda chunk: None)
    with pytest.raises(InvalidSamplingParam, match="must be in \\[0, "):
        engine.core.submit([1, -1], LONG, lambda chunk: None)
    with pytest.raises(InvalidSamplingParam, match="n must be an integer"):
        engine.generate(input_ids=[1, 2], sampling_params={"n": 1.5})
    assert engine.core.queued_requests() == 0 and not engine.core.scheduler.has_work()


def test_a_failure_making_one_requests_output_fails_it_alone(engine, monkeypatch):
    original = live_requests_module.LiveRequests._deliver

    def fails_for_one(self, sampled, *args):
        if sampled[0].rid == "faulty":  # a row: (request, live, token, ...)
            raise RuntimeError("a bug tied to this request")
        return original(self, sampled, *args)

    monkeypatch.setattr(live_requests_module.LiveRequests, "_deliver", fails_for_one)
    neighbour = _submit(engine, [5, 6, 7])
    faulty = _submit(engine, [8, 9], rid="faulty")
    ok, failed = _finals([neighbour, faulty])
    assert ok.error is None and ok.finish.reason == "length"
    assert failed.error == "internal error (RuntimeError)"
    assert engine.core.is_alive() and engine.core.scheduler.token_usage() == 0


def test_a_failed_step_fails_its_rows_and_the_waiting_requests_go_on(engine, monkeypatch):
    """Four requests fill every slot; the first step fails; the two that waited for a slot were in
    no step and finish normally."""
    runner = engine.core.runner
    gate, failed_once = threading.Event(), []
    real_run = runner.run

    def failing_once(*args, **kwargs):
        gate.wait(30)  # until every request is submitted
        if not failed_once:
            failed_once.append(True)
            raise RuntimeError("a fault of the step itself")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(runner, "run", failing_once)
    sinks = [_submit(engine, [10 + i, 11]) for i in range(6)]
    gate.set()
    finals = _finals(sinks)
    errors = [f for f in finals if f.error is not None]
    lengths = [f for f in finals if f.finish.reason == "length"]
    assert 1 <= len(errors) <= 4 and all("RuntimeError" in f.error for f in errors)
    assert len(lengths) == 6 - len(errors) >= 2
    assert engine.core.is_alive()


def test_the_queue_is_bounded(engine, monkeypatch):
    """Beyond --max-queued-requests a request is refused (QueueFull: the server's 503), never
    queued; slots free for the taking do not count as a queue."""
    import dataclasses

    monkeypatch.setattr(engine.core, "limits",
                        dataclasses.replace(engine.core.limits, max_queued_requests=2))
    runner, gate = engine.core.runner, threading.Event()
    real_run = runner.run

    def held(*args, **kwargs):
        gate.wait(30)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(runner, "run", held)
    try:
        sinks = [_submit(engine, [1, 2]) for _ in range(4 + 2)]  # 4 slots, then 2 wait
        with pytest.raises(QueueFull, match="--max-queued-requests 2"):
            _submit(engine, [1, 2])
    finally:
        gate.set()
    assert all(f.error is None for f in _finals(sinks))
    assert engine.core.queued_requests() == 0


def test_aborting_thousands_of_queued_requests_is_linear(engine):
    """Every aborted request gets its final chunk; 3000 waiting requests go in one pass."""
    runner, gate = engine.core.runner, threading.Event()
    real_run = runner.run
    engine.core.runner.run = lambda *a, **k: (gate.wait(30), real_run(*a, **k))[1]
    try:
        sinks, rids = [], []
        for i in range(3000):
            sink: queue.Queue = queue.Queue()
            rids.append(engine.core.submit([1, 2], LONG, sink.put, rid=f"queued-{i}"))
            sinks.append(sink)
        started = time.perf_counter()
        for rid in rids:
            engine.core.abort(rid, "cancelled")
        gate.set()
        finals = _finals(sinks)
        elapsed = time.perf_counter() - started
    finally:
        gate.set()
        del engine.core.runner.run
    assert sum(f.error == "cancelled" for f in finals) >= 3000 - 4
    assert elapsed < 10  # one by one over a 3000-long queue took minutes (Request.__eq__ scans)
    assert not engine.core.scheduler.has_work()


def test_scheduler_abort_many_is_one_pass_over_the_queue():
    scheduler = Scheduler(PageAllocator(64), page_size=4, max_running_requests=2,
                          chunked_prefill_size=8, max_prefill_tokens=16, context_length=64)
    requests = [Request(rid=str(i), prompt_ids=[1, 2, 3], max_new_tokens=4,
                        sampling=RowSamplingParams(seed=0)) for i in range(20000)]
    for request in requests:
        scheduler.add(request)
    scheduler.schedule()  # two of them run
    started = time.perf_counter()
    scheduler.abort_many([r.rid for r in requests] + ["unknown", "0"])
    assert time.perf_counter() - started < 2  # `abort` one at a time: ~20000 list scans
    assert not scheduler.has_work() and scheduler.allocator.num_used == 0
    assert all(r.status == "finished" and r.finish_reason == ("abort", None) for r in requests)
