"""--debug-step-hash-interval (issue 22), in one process: the leader's command log goes over a
socket pair to a follower thread that replays it on its own copy of the model (runtime/distributed/follower.py
`replay`; no jax.distributed and no collectives, both copies on this process's device). With the
same weights every checked step's digest agrees and the served tokens are the one-process ones;
with other weights on the follower (a host with other model files), the leader breaks the group
at the first checked step, naming the step and the rank, and the request fails instead of
answering."""
import socket
import threading
import types

import pytest

from tests.engine.test_engine import GREEDY, PROMPTS, SMALL
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.weights.loader import load_model
from xlaserve.offline import Engine
from xlaserve.runtime.distributed import setup
from xlaserve.runtime.distributed.follower import replay
from xlaserve.runtime.distributed.channel import TO_FOLLOWER, TO_LEADER, ChannelClosed, Connection, new_secret


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    same = str(tmp_path_factory.mktemp("llama-a"))
    other = str(tmp_path_factory.mktemp("llama-b"))
    make_tiny_checkpoint(same, "llama", seed=0)
    make_tiny_checkpoint(other, "llama", seed=1)
    return same, other


@pytest.fixture(scope="module")
def reference(checkpoints):
    with Engine(checkpoints[0], max_total_tokens=512, **SMALL) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


class Follower(threading.Thread):
    """Replays what arrives on its end of the socket pair on `loaded`; `outcome` says how it
    ended."""

    last = None  # the latest started, for a test whose engine failed to start

    def __init__(self, connection, loaded):
        super().__init__(daemon=True)
        self.connection, self.loaded, self.outcome = connection, loaded, None
        Follower.last = self

    def run(self):
        try:
            replay(self.connection, self.loaded)
            self.outcome = "shutdown"
        except ChannelClosed:
            self.outcome = "lost the leader"


def _group(monkeypatch, leader_model: str, follower_model: str, interval: int):
    """An offline Engine as the leader of a two-node group whose follower is a thread."""
    secret = new_secret()
    leader_end, follower_end = socket.socketpair()
    to_follower = Connection(leader_end, secret, TO_FOLLOWER, TO_LEADER)
    follower = Follower(Connection(follower_end, secret, TO_LEADER, TO_FOLLOWER),
                        load_model(follower_model, dtype="float32", skip_tokenizer_init=True))
    follower.start()
    listener = types.SimpleNamespace(wait=lambda timeout_s: {1: to_follower}, secret=secret)
    monkeypatch.setattr(setup, "_listener", listener)
    monkeypatch.setattr(setup, "initialize", lambda args: None)  # no jax.distributed here
    engine = Engine(leader_model, max_total_tokens=512, nnodes=2, dist_init_addr="127.0.0.1:1",
                    debug_step_hash_interval=interval, **SMALL)
    return engine, follower


def _every_step_checked(engine, interval: int) -> None:
    """Every interval-th step is checked, once every follower's digest came back."""
    leader = engine.core.group
    steps = engine.core.runner.sink._steps
    assert steps > 6
    expected = len(range(0, steps, interval))
    for _ in range(100):
        if leader.steps_checked == expected:
            break
        threading.Event().wait(0.05)
    assert leader.steps_checked == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("interval", [1, 3])
def test_a_follower_with_the_same_model_agrees_on_every_checked_step(
        checkpoints, reference, monkeypatch, interval):
    engine, follower = _group(monkeypatch, checkpoints[0], checkpoints[0], interval)
    with engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == reference
        assert engine.core.failure is None
        _every_step_checked(engine, interval)
    follower.join(timeout=30)
    assert follower.outcome == "shutdown"


@pytest.mark.timeout(300)
def test_page_writes_past_a_steps_room_reach_the_follower_before_its_step(
        checkpoints, reference, monkeypatch):
    """With room for 2 page writes a step, every admission's pages go through write_pages
    (runtime/executor/page_table.py), which the follower replays before the step: a follower that
    missed them would attend over other pages, and the checked digests would differ."""
    from xlaserve.runtime.executor import model_runner, page_table
    monkeypatch.setattr(page_table, "write_capacity", lambda tokens, seqs, page_size: 2)
    calls = []
    write_pages = model_runner.ModelRunner.write_pages

    def counted(runner, positions, pages):
        calls.append(len(positions))
        return write_pages(runner, positions, pages)
    monkeypatch.setattr(model_runner.ModelRunner, "write_pages", counted)
    engine, follower = _group(monkeypatch, checkpoints[0], checkpoints[0], 1)
    with engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == reference
        assert engine.core.failure is None
        _every_step_checked(engine, 1)
    follower.join(timeout=30)
    assert follower.outcome == "shutdown"
    assert len(calls) >= 2 and max(calls) > 2  # the leader's and the follower's, at least


@pytest.mark.timeout(300)
def test_a_follower_with_other_weights_breaks_the_group_at_the_first_checked_step(
        checkpoints, monkeypatch):
    # Precompiling runs idle steps through the group, so the mismatch may show while the engine
    # starts (it fails to start) or in the first request (it fails); never as tokens.
    follower = None
    try:
        engine, follower = _group(monkeypatch, checkpoints[0], checkpoints[1], 1)
    except setup.PeerLost as error:
        assert "step 0 diverged: follower rank 1" in str(error)
    else:
        with engine:
            finish = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["meta_info"][
                "finish_reason"]
            assert finish["type"] == "abort", finish
            assert "step 0 diverged: follower rank 1" in finish["message"]
            assert "step 0 diverged: follower rank 1" in engine.core.failure
            assert not engine.core.is_alive()
            with pytest.raises(RuntimeError, match="step 0 diverged"):  # no more work is taken
                engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    follower = follower or Follower.last
    follower.join(timeout=30)
    assert follower.outcome == "lost the leader"


@pytest.mark.timeout(300)
def test_a_refused_or_failing_request_never_breaks_the_group(checkpoints, reference, monkeypatch):
    """A request refused in submit reaches no follower; one whose output fails on the leader
    (after its step ran everywhere) fails alone. The group goes on with the same tokens."""
    import queue

    from xlaserve.runtime.engine import live_requests

    engine, follower = _group(monkeypatch, checkpoints[0], checkpoints[0], 0)
    original = live_requests.LiveRequests._deliver

    def fails_for_one(self, sampled, *args):
        if sampled[0].rid == "faulty":  # a row: (request, live, token, ...)
            raise RuntimeError("a bug tied to this request")
        return original(self, sampled, *args)

    with engine:
        with pytest.raises(ValueError, match="top_k"):
            engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "top_k": 2**31})
        with pytest.raises(ValueError, match="stop must be"):
            engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "stop": 5})
        monkeypatch.setattr(live_requests.LiveRequests, "_deliver", fails_for_one)
        sink: queue.Queue = queue.Queue()
        engine.core.submit(PROMPTS[1], engine_params(GREEDY), sink.put, rid="faulty")
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        chunk = sink.get(timeout=60)
        while not chunk.finished:
            chunk = sink.get(timeout=60)
        assert chunk.error == "internal error (RuntimeError)"
        assert [o["output_ids"] for o in outputs] == reference
        assert engine.core.failure is None and engine.core.is_alive()
    follower.join(timeout=30)
    assert follower.outcome == "shutdown"


def engine_params(params: dict):
    from xlaserve.offline import to_sampling_params

    return to_sampling_params(params)[0]
