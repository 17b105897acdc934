"""Multi-host serving on one machine (issue 22): two `python -m xlaserve.launch_server` processes,
`--nnodes 2`, each with 2 fake CPU devices, tensor parallel over all four (gloo collectives), a
tiny model with the default model's tokenizer. Greedy tokens through the leader's HTTP equal a
one-process tp=1 run's, for a mixed workload (concurrent prompts, a stream, n > 1, an abort,
retraction in a small KV pool, a regex-constrained request, a text completion), and every 2nd
step's sampled outputs hash the same in both processes (--debug-step-hash-interval); killing
the follower mid-stream fails the stream and turns the leader's answers to 503 instead of
hanging; a follower ends with its leader (status 0 on a clean stop, 1 when the leader is lost).
Every process is stopped by its pid."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import orjson
import pytest

from tests.http.conftest import _free_port, launch_server_process
from tests.engine.test_engine import PROMPTS  # the same mixed prompt lengths
from tests.tiny_models import make_tiny_checkpoint

NEW_TOKENS = 40
GREEDY = {"temperature": 0, "ignore_eos": True}
# A KV pool of 160 tokens for 4 running requests of up to 66: the scheduler must retract. Two step
# programs: (4 tokens, 4 seqs) for decodes, (16, 4) for steps with prompt tokens.
SERVER = dict(dtype="float32", page_size=4, max_running_requests=4,
              context_length=256, chunked_prefill_size=16, max_prefill_tokens=16,
              max_total_tokens=160, precompile_token_paddings="4,16", precompile_bs_paddings="4",
              random_seed=0)
FAKE_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}


REGEX = "[0-9]{3}-[a-z]{2,5}"  # grammar masks go to the follower with the step


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from xlaserve.weights.formats import gguf_file
    from xlaserve.weights.loader import default_model_file

    directory = str(tmp_path_factory.mktemp("tiny-qwen2-kv4"))
    # 4 kv heads: one per device; the default model's vocabulary and tokenizer.
    make_tiny_checkpoint(directory, "qwen2", vocab_size=49152, num_key_value_heads=4)
    gguf_file.load_tokenizer(default_model_file()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference(model):
    """The one-process tp=1 greedy outputs: every prompt's tokens, the regex request's, and the
    text of the first prompt's first 16 tokens."""
    from xlaserve.offline import Engine

    with Engine(model, **SERVER) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params={**GREEDY,
                                                                      "max_new_tokens": NEW_TOKENS})
        regex = engine.generate(input_ids=PROMPTS[5], sampling_params={
            "temperature": 0, "max_new_tokens": 12, "regex": REGEX})
        text = engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 16})
    return {"tokens": [o["output_ids"] for o in outputs], "regex": regex["output_ids"],
            "text": text["text"]}


def _flags(model: str) -> list[str]:
    flags = ["--model-path", model, "--tp-size", "4", "--nnodes", "2"]
    for name, value in SERVER.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def _dist_port() -> int:
    """A free port whose successor (the step channel) is free too."""
    while True:
        port = _free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


class Pair:
    """A leader and a follower on 127.0.0.1; `stop()` kills whatever still runs, by pid."""

    def __init__(self, model: str, tmp_path, monkeypatch, leader_flags=(), flags=()):
        for name, value in FAKE_DEVICES.items():
            monkeypatch.setenv(name, value)
        address = f"127.0.0.1:{_dist_port()}"
        # Every 2nd step's sampled outputs are compared across the processes (a debug check).
        common = [*_flags(model), *flags, "--dist-init-addr", address,
                  "--debug-step-hash-interval", "2"]
        self.follower_log = tmp_path / "follower.log"
        self.leader_log = tmp_path / "leader.log"
        self.processes = []
        with open(self.follower_log, "w") as log:
            self.follower = subprocess.Popen(
                [sys.executable, "-m", "xlaserve.launch_server", *common, "--node-rank", "1",
                 "--file-storage-path", str(tmp_path / "storage-1")],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.processes.append(self.follower)
        try:
            self.leader, self.base_url = launch_server_process(
                [*common, "--node-rank", "0", "--file-storage-path", str(tmp_path / "storage-0"),
                 *leader_flags],
                self.leader_log, timeout=180)
        except BaseException:
            self.stop()
            raise
        self.processes.append(self.leader)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


@pytest.fixture
def pair(model, tmp_path, monkeypatch):
    running = Pair(model, tmp_path, monkeypatch)
    try:
        yield running
    finally:
        running.stop()


def _events(response) -> list[dict]:
    return [orjson.loads(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.timeout(300)
def test_two_processes_serve_the_one_process_tokens_then_fail_fast_without_the_follower(
        pair, reference):
    """The pair (--nnodes 2) answers the one-process tokens, then fails fast once its follower
    is gone. Over 20 s: the first test of the module pays the shared pair's start (two
    processes join, load the model and precompile)."""
    url = pair.base_url
    results, errors = {}, []

    def run(name, fn):
        try:
            results[name] = fn()
        except Exception as error:  # noqa: BLE001: reported below, with its name
            errors.append((name, repr(error)))

    def batch():  # six prompts in one request: four run at once and the pool retracts
        body = {"input_ids": PROMPTS, "sampling_params": {**GREEDY, "max_new_tokens": NEW_TOKENS}}
        response = httpx.post(url + "/generate", json=body, timeout=120)
        response.raise_for_status()
        return [o["output_ids"] for o in response.json()]

    def stream():
        body = {"input_ids": PROMPTS[2], "stream": True,
                "sampling_params": {**GREEDY, "max_new_tokens": 25}}
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as response:
            return _events(response)

    def n_two():
        body = {"input_ids": PROMPTS[4], "sampling_params": {**GREEDY, "max_new_tokens": 20, "n": 2}}
        response = httpx.post(url + "/generate", json=body, timeout=120)
        response.raise_for_status()
        return [o["output_ids"] for o in response.json()]

    def regex():
        body = {"input_ids": PROMPTS[5], "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "regex": REGEX}}
        response = httpx.post(url + "/generate", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["output_ids"], response.json()["text"]

    def completion():  # the OpenAI route, token ids in, text out
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    def aborted():  # the client goes away after three chunks: the server aborts the request
        body = {"input_ids": PROMPTS[0], "stream": True,
                "sampling_params": {**GREEDY, "max_new_tokens": 100}}
        seen = 0
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as response:
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
        return seen

    threads = [threading.Thread(target=run, args=(name, fn)) for name, fn in
               [("batch", batch), ("stream", stream), ("n", n_two), ("aborted", aborted),
                ("regex", regex), ("completion", completion)]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors
    tokens = reference["tokens"]
    assert results["batch"] == tokens
    events = results["stream"]
    assert len(events) > 1 and all("error" not in e for e in events)
    assert events[-1]["output_ids"] == tokens[2][:25]
    assert results["n"] == [tokens[4][:20]] * 2
    assert results["aborted"] == 3
    assert results["regex"][0] == reference["regex"] and re.fullmatch(REGEX, results["regex"][1])
    assert results["completion"] == reference["text"]
    log = pair.leader_log.read_text()
    if "Retract requests" not in log:
        # The mix shares the four slots, and did not fill the pool this time (a busy machine
        # spreads the requests out); the batch's first four alone need 52 of the 40 pages.
        assert batch() == tokens
        log = pair.leader_log.read_text()
    assert "Retract requests" in log
    assert "Step hash check: 1 step(s) agree on every follower" in log and "diverged" not in log
    deadline = time.monotonic() + 30  # the abort frees its slot
    while httpx.get(url + "/get_server_info").json()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(url + "/get_server_info").json()["num_running_reqs"] == 0
    again = httpx.post(url + "/generate", json={"input_ids": PROMPTS[3], "sampling_params": {
        **GREEDY, "max_new_tokens": 8}}, timeout=60).json()
    assert again["output_ids"] == tokens[3][:8]

    # The follower dies mid-stream: the stream ends with an error, the leader answers 503.
    body = {"input_ids": PROMPTS[1], "stream": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 150}}
    killed_at = None
    events = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(orjson.loads(line[6:]))
            if len(events) == 3 and killed_at is None:
                os.kill(pair.follower.pid, signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None and time.monotonic() - killed_at < 15
    assert any("error" in e or "error" in e.get("meta_info", {}) for e in events[3:]), events[3:]
    assert len([e for e in events if "output_ids" in e][-1]["output_ids"]) < 150
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and "lost follower rank 1" in health.text, health.text
    refused = httpx.post(url + "/generate", json={"input_ids": [1, 2]}, timeout=10)
    assert refused.status_code == 503, refused.text
    assert pair.leader.poll() is None  # it answers; it does not hang and has not crashed


@pytest.mark.timeout(180)
def test_a_follower_that_stops_answering_turns_the_leader_to_503_within_the_watchdog_timeout(
        model, tmp_path, monkeypatch):
    """Over 20 s: a pair of its own (the leader's --watchdog-timeout) starts, loads and
    precompiles, then waits out the 4 s watchdog."""
    # SIGSTOP: the follower's connections stay open and its heartbeats have 100 s to go, so only
    # the leader's --watchdog-timeout notices the step that cannot finish.
    pair = Pair(model, tmp_path, monkeypatch, leader_flags=["--watchdog-timeout", "4"])
    try:
        url = pair.base_url
        reply = httpx.post(url + "/generate", json={"input_ids": PROMPTS[3], "sampling_params": {
            **GREEDY, "max_new_tokens": 4}}, timeout=60)
        assert reply.status_code == 200
        os.kill(pair.follower.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        body = {"input_ids": PROMPTS[1], "stream": True,
                "sampling_params": {**GREEDY, "max_new_tokens": 100}}
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as response:
            events = _events(response)
        assert time.monotonic() - stopped_at < 30
        assert "stuck in one step" in str(events[-1]), events[-1]
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "--watchdog-timeout 4" in health.text, health.text
        assert pair.leader.poll() is None
    finally:
        pair.stop()  # SIGKILL ends a stopped process too


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_the_follower_ends_with_its_leader(pair, how):
    reply = httpx.post(pair.base_url + "/generate", json={"input_ids": PROMPTS[3], "sampling_params": {
        **GREEDY, "max_new_tokens": 4}}, timeout=60)
    assert reply.status_code == 200
    os.kill(pair.leader.pid, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    follower_status = pair.follower.wait(timeout=60)
    log = pair.follower_log.read_text()
    if how == "sigterm":  # a clean stop: the leader tells the follower, both shut down together
        assert pair.leader.wait(timeout=60) in (0, -signal.SIGTERM)
        assert follower_status == 0, log[-2000:]
        assert "The leader shut down; node rank 1 exits" in log
    else:  # ours or JAX's coordination client notices first; either way it does not hang
        assert follower_status != 0
        assert ("node rank 1 lost the leader (rank 0)" in log
                or "JAX distributed service detected fatal errors" in log), log[-2000:]


@pytest.mark.timeout(180)
def test_a_tp_size_that_is_not_every_device_is_refused_on_every_rank(model, tmp_path, monkeypatch):
    for name, value in FAKE_DEVICES.items():
        monkeypatch.setenv(name, value)
    flags = [*_flags(model), "--tp-size", "2", "--dist-init-addr", f"127.0.0.1:{_dist_port()}"]
    processes = [subprocess.Popen(
        [sys.executable, "-m", "xlaserve.launch_server", *flags, "--node-rank", str(rank),
         "--file-storage-path", str(tmp_path / f"storage-{rank}")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        for process in processes:
            out, _ = process.communicate(timeout=120)
            assert process.returncode == 2, out[-2000:]
            assert ("--tp-size 2 x --dp-size 1 must equal the devices of all 2 processes together: "
                    "found 4 cpu devices (rank 0: 2, rank 1: 2)") in out
    finally:
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


@pytest.mark.slow  # two more processes and a reference run: ~1 min on a 2-core CPU
@pytest.mark.timeout(300)
def test_expert_parallel_across_two_processes_serves_the_one_process_tokens(tmp_path_factory,
                                                                           tmp_path, monkeypatch):
    """--ep-size composes with --nnodes: a tiny Qwen3-MoE's 8 experts over 4 devices of two
    processes (2 each), attention over the same 4; the leader's greedy tokens equal one process
    with one device."""
    from xlaserve.weights.formats import gguf_file
    from xlaserve.weights.loader import default_model_file
    from xlaserve.offline import Engine

    directory = str(tmp_path_factory.mktemp("tiny-qwen3-moe-kv4"))
    make_tiny_checkpoint(directory, "qwen3_moe", vocab_size=49152, num_key_value_heads=4)
    gguf_file.load_tokenizer(default_model_file()).save_pretrained(directory)
    sampling = {**GREEDY, "max_new_tokens": 12}
    with Engine(directory, **SERVER) as engine:
        expected = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS[:4],
                                                             sampling_params=sampling)]
    pair = Pair(directory, tmp_path, monkeypatch, flags=["--ep-size", "4"])
    try:
        response = httpx.post(pair.base_url + "/generate", timeout=120,
                              json={"input_ids": PROMPTS[:4], "sampling_params": sampling})
        response.raise_for_status()
        assert [o["output_ids"] for o in response.json()] == expected
    finally:
        pair.stop()


def _one_at_a_time_verified_rows(running, reference, prompts) -> int:
    """Sends `prompts` (indices of PROMPTS) one at a time, greedy, and checks each output is the
    one-process reference's; returns the verified rows they ran."""
    verified = 0
    for i in prompts:
        body = {"input_ids": PROMPTS[i], "sampling_params": {**GREEDY, "max_new_tokens": NEW_TOKENS}}
        response = httpx.post(running.base_url + "/generate", json=body, timeout=120)
        response.raise_for_status()
        assert response.json()["output_ids"] == reference["tokens"][i]
        verified += response.json()["meta_info"].get("spec_verify_ct", 0)
    return verified


@pytest.mark.timeout(300)
def test_speculative_decoding_across_two_processes_serves_the_one_process_tokens(
        model, reference, tmp_path, monkeypatch):
    """--speculative-algorithm NGRAM with --nnodes 2: the follower builds its runner with the
    leader's verified-row size and replays the verify steps (the step hash check compares
    their outputs every 2nd step); one request at a time, so that its drafts fit the 4-token
    steps."""
    running = Pair(model, tmp_path, monkeypatch, flags=["--speculative-algorithm", "NGRAM"])
    try:
        verified = _one_at_a_time_verified_rows(running, reference, (0, 2))
        body = {"input_ids": PROMPTS[5], "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "regex": REGEX}}
        response = httpx.post(running.base_url + "/generate", json=body, timeout=120)
        assert response.json()["output_ids"] == reference["regex"]
        # A token the bias makes certain repeats: every step after the first verifies 3 drafts.
        body = {"input_ids": PROMPTS[1] + [7], "sampling_params": {
            **GREEDY, "max_new_tokens": 20, "logit_bias": {"7": 100.0}}}
        response = httpx.post(running.base_url + "/generate", json=body, timeout=120)
        assert response.json()["output_ids"] == [7] * 20
        verified += response.json()["meta_info"].get("spec_verify_ct", 0)
        assert verified > 0
        assert running.follower.poll() is None  # no step hash mismatch ended it
    finally:
        running.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [["--speculative-num-steps", "3"],
                                   ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2"]],
                         ids=["chain", "tree"])
def test_an_eagle3_draft_head_across_two_processes_serves_the_one_process_tokens(
        model, reference, tmp_path, monkeypatch, shape):
    """--speculative-algorithm EAGLE3 with --nnodes 2: each process loads the head onto its
    devices, the head's catch-up rides in the replayed steps and the follower replays the
    leader's draft chains or trees (precompiled as idle chains by both; a tree's steps are the
    tree program, its width in the step message); one request at a time, so that its drafts
    fit the 4-token steps. Over 20 s each: a pair of its own (its flags), whose two processes
    load the model and the head and precompile both."""
    from benchmarks.random_heads import write_random_eagle3_head

    head = str(tmp_path / "head")
    write_random_eagle3_head(head, hidden=64, heads=4, kv_heads=4, vocab=49152,
                             intermediate=96, draft_vocab=4096, capture=(0, 0, 0))
    running = Pair(model, tmp_path, monkeypatch, flags=[
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head, *shape])
    try:
        verified = _one_at_a_time_verified_rows(running, reference, (0, 2))
        assert verified > 0
        assert running.follower.poll() is None  # no step hash mismatch ended it
    finally:
        running.stop()


@pytest.mark.timeout(300)
def test_a_standalone_draft_model_across_two_processes_serves_the_one_process_tokens(
        model, reference, tmp_path, monkeypatch):
    """--speculative-algorithm STANDALONE with --nnodes 2, the model as its own draft (its greedy
    drafts are the model's tokens, kept): every process builds the draft model's runner beside
    the model's, and the follower replays the leader's draft steps ("draft_model_" commands).
    Over 20 s: a pair of its own, each process precompiling the model's and the draft's steps."""
    running = Pair(model, tmp_path, monkeypatch, flags=[
        "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model,
        "--speculative-num-draft-tokens", "4"])
    try:
        body = {"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": NEW_TOKENS}}
        response = httpx.post(running.base_url + "/generate", json=body, timeout=120)
        response.raise_for_status()
        assert response.json()["output_ids"] == reference["tokens"][0]
        assert response.json()["meta_info"]["spec_accept_length"] > 2
        assert running.follower.poll() is None  # no step hash mismatch ended it
    finally:
        running.stop()
