"""A server killed with SIGKILL in the middle of a batch, started again on the same storage
folder, finishes the batch: exactly one output line per custom_id, the right counts, and only
the lines that had no result were run again (the engine's request counter says how many)."""
import json
import os
import re
import signal
import subprocess
import time

import httpx
from openai import OpenAI

from tests.http.conftest import SERVER_DEFAULTS, launch_server_process

NUM_LINES = 400
# The in-process test server's engine settings, as flags.
FLAGS = [x for k, v in SERVER_DEFAULTS.items() for x in (f"--{k.replace('_', '-')}", str(v))] + [
    "--served-model-name", "tiny", "--enable-metrics"]


def _start(model_dir: str, storage: str, log_path) -> tuple[subprocess.Popen, str]:
    return launch_server_process(["--model-path", model_dir, "--file-storage-path", storage, *FLAGS],
                                 log_path, timeout=300)


def _requests_run(base_url: str) -> int:
    text = httpx.get(base_url + "/metrics").text
    return round(sum(float(v) for v in re.findall(r'^xlaserve:num_requests_total\{.*\} (\S+)$', text, re.M)))


def _complete_lines(path: str) -> int:
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def test_a_batch_survives_sigkill_and_resumes_without_losing_or_repeating_a_line(tiny_chat_model, tmp_path):
    """A real server process killed mid-batch and started again on the same storage: ~24 s, two
    server start-ups (each compiling its steps) and the batch's lines decoded in between."""
    storage, log_path = str(tmp_path / "storage"), tmp_path / "server.log"
    process, base_url = _start(tiny_chat_model[0], storage, log_path)
    try:
        client = OpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0)
        lines = [{"custom_id": f"request-{i}", "method": "POST", "url": "/chat/completions",
                  "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Story {i}"}],
                           "max_tokens": 8, "logit_bias": {"0": -100, "2": -100}}}
                 for i in range(NUM_LINES)]
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = client.files.create(file=("input.jsonl", content), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.request_counts.completed < 40:
            assert time.monotonic() < deadline and batch.status in ("validating", "in_progress"), batch
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert batch.status == "in_progress" and batch.request_counts.completed < NUM_LINES
    # What reached the disk before the kill (a line cut in half does not count: it runs again).
    blobs = [os.path.join(storage, "files", n) for n in os.listdir(os.path.join(storage, "files"))
             if n != uploaded.id]
    assert len(blobs) == 2  # the output and error files being written
    done_at_kill = sum(_complete_lines(path) for path in blobs)
    assert batch.request_counts.completed <= done_at_kill < NUM_LINES

    process, base_url = _start(tiny_chat_model[0], storage, log_path)
    try:
        client = OpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0)
        assert client.files.content(uploaded.id).read() == content
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (NUM_LINES, NUM_LINES, 0)
        text = client.files.content(batch.output_file_id).read().decode()
        custom_ids = [json.loads(line)["custom_id"] for line in text.splitlines()]
        assert sorted(custom_ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
        assert all(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] == 8
                   for line in text.splitlines())
        # The restarted server ran the warm-up and the lines that had no result, nothing more.
        assert _requests_run(base_url) == 1 + NUM_LINES - done_at_kill
        assert "Resuming batch " + batch.id in log_path.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def test_a_batch_stopped_with_its_server_resumes_in_the_next_one(server, tmp_path):
    """The graceful path (SIGTERM, or the app's lifespan ending): lines in flight are aborted,
    the batch stays in_progress on disk, and the next app on the folder finishes it."""
    from tests.http.conftest import AppServer
    from xlaserve.http.app import create_app
    from xlaserve.http.batches.runner import BatchRunner
    from xlaserve.http.batches.storage import Storage

    def app_on(folder):
        runner = BatchRunner(server.ctx, Storage(folder), max_file_size=1 << 20, max_lines=1000,
                             concurrency=8)
        return AppServer(create_app(server.ctx, batch_runner=runner), server.ctx)

    first = app_on(str(tmp_path))
    client = first.openai()
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"Item {i}", "max_tokens": 6, "logit_bias": {"0": -100}}}
             for i in range(120)]
    uploaded = client.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    while batch.request_counts.completed < 10:
        time.sleep(0.02)
        batch = client.batches.retrieve(batch.id)
    first.close()
    deadline = time.monotonic() + 2
    while sum(server.ctx.engine.core.stats()[k] for k in ("num_running_reqs", "num_queue_reqs")):
        assert time.monotonic() < deadline, "the stopped batch's lines were not aborted"
        time.sleep(0.01)

    second = app_on(str(tmp_path))
    try:
        client = second.openai()
        deadline = time.monotonic() + 60
        while batch.status != "completed":
            assert time.monotonic() < deadline and batch.status in ("in_progress", "finalizing"), batch
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
        assert (batch.request_counts.completed, batch.request_counts.failed) == (120, 0)
        text = client.files.content(batch.output_file_id).read().decode()
        assert sorted(json.loads(x)["custom_id"] for x in text.splitlines()) == sorted(x["custom_id"] for x in lines)
    finally:
        second.close()
