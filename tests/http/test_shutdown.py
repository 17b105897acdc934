"""SIGTERM to `python -m xlaserve.launch_server` (http/shutdown.py): the server stops admitting at
once (503 with Retry-After, /health 503), lets what runs finish within
--graceful-shutdown-timeout, aborts the rest with an error (streams: an SSE error event, then
[DONE]; a waiting client: a 503; a batch line: not written, so its batch resumes), and exits 0.

Two real servers on the tiny chat model (about 15 s each to start); one stream of the tiny model
decodes 400 to 800 tokens a second on a 2-core CPU."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.http.conftest import launch_server_process

FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-running-requests", "8",
         "--context-length", "4096", "--max-total-tokens", "32768", "--chunked-prefill-size", "64",
         "--max-prefill-tokens", "128", "--precompile-token-paddings", "8,64", "--random-seed", "0"]
STREAM_TOKENS = 2500
SHUTDOWN_ERROR = {"message": "the server is shutting down", "type": "service_unavailable",
                  "param": None, "code": None}


def _start(model_dir: str, folder, graceful_timeout: float):
    process, base_url = launch_server_process(
        ["--model-path", model_dir, "--file-storage-path", str(folder / "storage"), *FLAGS,
         "--graceful-shutdown-timeout", str(graceful_timeout)], folder / "server.log", timeout=300)
    return process, base_url


def _completion(max_tokens: int, **fields) -> dict:
    return {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **fields}


class StreamReader(threading.Thread):
    """Reads one SSE stream of /v1/completions: its events (JSON payloads, and "[DONE]") as they
    arrive."""

    def __init__(self, base_url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = base_url + "/v1/completions", {**body, "stream": True}
        self.events: list = []
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.events.append(data if data == "[DONE]" else json.loads(data))


def _wait_until(condition, timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _health(base_url: str) -> int | None:
    try:
        return httpx.get(base_url + "/health", timeout=5).status_code
    except httpx.HTTPError:  # not listening
        return None


@pytest.fixture(scope="module")
def drained(tiny_chat_model, tmp_path_factory):
    """A stream of 2,500 tokens (about 5 s) running when SIGTERM comes, under a 60 s timeout;
    while it drains, /health and a new request. -> what each saw, and how the process ended."""
    process, base_url = _start(tiny_chat_model[0], tmp_path_factory.mktemp("drained"), 60)
    try:
        body = _completion(STREAM_TOKENS, stream_options={"include_usage": True})
        stream = StreamReader(base_url, body)
        _wait_until(lambda: len(stream.events) >= 5, what="the stream's first tokens")
        process.send_signal(signal.SIGTERM)
        events_at_signal = len(stream.events)
        deadline = time.monotonic() + 5
        while _health(base_url) != 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            health = httpx.get(base_url + "/health", timeout=5)
            refused = httpx.post(base_url + "/v1/completions", json=_completion(4), timeout=30)
        except httpx.HTTPError as error:  # the listener closed at the signal
            health = refused = error
        events_while_draining = len(stream.events)
        stream.join(timeout=60)
        exit_status = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    return dict(stream=stream, events_at_signal=events_at_signal, health=health,
                refused=refused, events_while_draining=events_while_draining,
                exit_status=exit_status)


def test_a_running_stream_finishes_and_the_server_exits_0(drained):
    events = drained["stream"].events
    assert drained["events_at_signal"] < drained["events_while_draining"] < len(events)
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["length"]
    assert events[-2]["usage"]["completion_tokens"] == STREAM_TOKENS
    assert drained["exit_status"] == 0  # uvicorn alone re-raises SIGTERM: -15


def test_new_requests_while_draining_get_503_with_retry_after(drained):
    for response in (drained["health"], drained["refused"]):
        assert isinstance(response, httpx.Response), response
        assert response.status_code == 503
        assert response.headers["retry-after"].isdigit()
        assert response.json() == {"error": SHUTDOWN_ERROR}


def test_what_outlives_the_timeout_is_aborted_and_the_server_exits_0(tiny_chat_model, tmp_path):
    """Under a 2 s timeout: a stream, a non-streamed request and a batch of 3 lines, each of
    4,000 tokens (over 10 s), are cut off; the batch stays in_progress with nothing written."""
    timeout = 2.0
    process, base_url = _start(tiny_chat_model[0], tmp_path, timeout)
    try:
        stream = StreamReader(base_url, _completion(4000))
        waiting: dict = {}
        waiter = threading.Thread(target=lambda: waiting.update(response=httpx.post(
            base_url + "/v1/completions", json=_completion(4000), timeout=120)), daemon=True)
        waiter.start()
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                  "body": _completion(4000)} for i in range(3)]
        uploaded = httpx.post(base_url + "/v1/files", data={"purpose": "batch"}, files={
            "file": ("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())}).json()
        batch = httpx.post(base_url + "/v1/batches", json={
            "input_file_id": uploaded["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"}).json()
        running = lambda: httpx.get(base_url + "/get_server_info").json()["num_running_reqs"]
        _wait_until(lambda: running() == 5, what="the 5 requests to run")
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        exit_status = process.wait(timeout=timeout + 30)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    assert exit_status == 0 and took < timeout + 8, (exit_status, took)

    stream.join(timeout=10)
    events = stream.events
    assert events[-1] == "[DONE]"
    errors = [e["error"] for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and "the server is shutting down" in errors[0]["message"]

    waiter.join(timeout=10)
    response = waiting["response"]
    assert response.status_code == 503 and response.json() == {"error": SHUTDOWN_ERROR}
    assert response.headers["retry-after"].isdigit()

    from xlaserve.http.batches.storage import Storage  # the folder, as the next server will find it

    storage = Storage(str(tmp_path / "storage"))
    try:
        saved = storage.batch(batch["id"])
        assert saved["status"] == "in_progress", saved
        for blob in (saved["_output"], saved["_errors"]):  # no line written: all 3 run again
            path = storage.blob_path(blob)
            assert not os.path.exists(path) or os.path.getsize(path) == 0
    finally:
        storage.close()
