"""Batches API through the openai SDK: SGLang's tutorial batch cells (2 requests to completion, 20
polled with counts, 5000 cancelled while running), completions batches, per-line errors in the
error file, input files that fail validation, 400/404s, list pagination, and a chat request
answered promptly while a large batch runs."""
import json
import time

import httpx
import openai
import pytest

from tests.http.conftest import AppServer

MODEL = "tiny"
NO_EOS = {"logit_bias": {"2": -100, "0": -100}}  # every request runs to max_tokens


def chat_line(custom_id: str, content: str, url: str = "/chat/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], **body}}


def upload(client, tmp_path, lines: list, name: str = "batch_requests.jsonl"):
    path = tmp_path / name
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch")


def wait(client, batch, until=("completed", "failed", "cancelled"), timeout=120.0, seen=None):
    deadline = time.monotonic() + timeout
    while batch.status not in until:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
        if seen is not None:
            seen.append(batch)
    return batch


def results(client, file_id) -> dict:
    text = client.files.content(file_id).read().decode("utf-8")
    lines = [json.loads(line) for line in text.split("\n") if line.strip() != ""]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines)  # one line per custom_id
    return by_id


def test_tutorial_cell_two_requests_to_completion(server, client, tmp_path):
    requests = [
        chat_line("request-1", "Tell me a joke about programming", max_tokens=50),
        chat_line("request-2", "What is Python?", max_tokens=50),
    ]
    file_response = upload(client, tmp_path, requests)
    batch_response = client.batches.create(input_file_id=file_response.id,
                                           endpoint="/v1/chat/completions", completion_window="24h")
    assert batch_response.status == "validating" and batch_response.id.startswith("batch_")
    batch_response = wait(client, batch_response)
    assert batch_response.status == "completed"
    counts = batch_response.request_counts
    assert (counts.total, counts.completed, counts.failed) == (2, 2, 0)
    b = batch_response
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at < b.expires_at
    assert b.error_file_id is None and b.errors is None and b.endpoint == "/v1/chat/completions"
    by_id = results(client, batch_response.output_file_id)
    assert set(by_id) == {"request-1", "request-2"}
    for result in by_id.values():
        response = result["response"]
        assert result["id"].startswith("batch_req_") and result["error"] is None
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and isinstance(body["choices"], list)
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert 1 <= body["usage"]["completion_tokens"] <= 50
    usage = batch_response.usage
    assert usage.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in by_id.values())
    assert client.files.retrieve(batch_response.output_file_id).purpose == "batch_output"
    client.files.delete(batch_response.output_file_id)


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def test_a_batch_body_is_what_the_live_endpoint_answers(server, client, tmp_path):
    bodies = {
        "chat": ("/v1/chat/completions", dict(model=MODEL, temperature=0, max_tokens=6, n=2, logprobs=True,
                                              top_logprobs=2, messages=[{"role": "user", "content": "Hi"}])),
        "text": ("/v1/completions", dict(model=MODEL, temperature=0, max_tokens=5, prompt=["a b", "c d"],
                                         logprobs=1, stop=["\n"])),
    }
    for name, (endpoint, body) in bodies.items():
        for url in (endpoint, endpoint.removeprefix("/v1")):
            uploaded = upload(client, tmp_path, [{"custom_id": name, "method": "POST", "url": url, "body": body}])
            batch = wait(client, client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,
                                                       completion_window="24h"))
            got = results(client, batch.output_file_id)[name]["response"]["body"]
            live = httpx.post(server.base_url + endpoint, json=body).json()
            for key in ("id", "created"):
                got.pop(key), live.pop(key)
            # Logprobs agree to float32 rounding: which rows share a step (the two choices
            # arrive together or one step apart) changes the last bits.
            assert _rounded(got) == _rounded(live)


def test_tutorial_cell_twenty_requests_polled_with_counts(client, tmp_path):
    requests = [chat_line(f"request-{i}", "Write a detailed story about topic. Make it very long.",
                          max_tokens=64) for i in range(20)]
    for i, request in enumerate(requests):
        request["body"]["messages"].insert(0, {"role": "system", "content": f"{i}: You are a helpful AI assistant"})
    uploaded = upload(client, tmp_path, requests)
    batch_job = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"cell": "twenty"})
    seen = []
    batch_job = wait(client, batch_job, seen=seen)
    assert batch_job.status == "completed" and batch_job.metadata == {"cell": "twenty"}
    counts = batch_job.request_counts
    assert (counts.total, counts.completed, counts.failed) == (20, 20, 0)
    progress = [b.request_counts.completed for b in seen]
    assert progress == sorted(progress)  # counts only grow
    assert {"in_progress", "completed"} <= {b.status for b in seen}
    assert len(results(client, batch_job.output_file_id)) == 20


def _engine_idle(server) -> bool:
    stats = server.ctx.engine.core.stats()
    return stats["num_running_reqs"] == 0 and stats["num_queue_reqs"] == 0


def test_tutorial_cell_cancel_a_5000_request_batch_while_it_runs(server, client, tmp_path):
    requests = [chat_line(f"request-{i}", f"Content {i}: tell a long story", max_tokens=128, **NO_EOS)
                for i in range(5000)]
    uploaded = upload(client, tmp_path, requests)
    batch_job = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
    deadline = time.monotonic() + 60
    while batch_job.request_counts.completed < 1 or server.ctx.engine.core.stats()["num_running_reqs"] < 4:
        assert time.monotonic() < deadline, batch_job  # some lines are done, others running
        time.sleep(0.05)
        batch_job = client.batches.retrieve(batch_job.id)
    with pytest.raises(openai.BadRequestError, match="still running"):
        client.files.delete(uploaded.id)
    cancelled_job = client.batches.cancel(batch_id=batch_job.id)
    cancelled_at = time.monotonic()
    assert cancelled_job.status == "cancelling" and cancelled_job.cancelling_at is not None
    while not _engine_idle(server):  # running lines are aborted, not waited for
        assert time.monotonic() - cancelled_at < 3.0, server.ctx.engine.core.stats()
        time.sleep(0.02)
    cancelled_job = wait(client, cancelled_job, until=("cancelled", "failed"), timeout=30)
    assert cancelled_job.status == "cancelled" and cancelled_job.cancelled_at >= cancelled_job.cancelling_at
    counts = cancelled_job.request_counts
    assert counts.total == 5000 and 1 <= counts.completed < 5000 and counts.failed == 0
    kept = results(client, cancelled_job.output_file_id)
    assert len(kept) == counts.completed
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 128 for r in kept.values())
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch_id=batch_job.id)  # already cancelled: a 400, not a 500
    del_response = client.files.delete(uploaded.id)
    assert del_response.deleted


def test_failing_lines_go_to_the_error_file_and_the_batch_completes(client, tmp_path):
    lines = [
        chat_line("ok", "hello", max_tokens=3),
        chat_line("empty", "x", max_tokens=3) | {"body": {"model": MODEL, "messages": []}},
        chat_line("negative", "x", max_tokens=-1),
        chat_line("long", "word " * 600, max_tokens=3),
        chat_line("stream", "x", max_tokens=3, stream=True),
        chat_line("model", "x", max_tokens=3) | {"body": {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}},
        # An unknown field is ignored, as on the live endpoint (without --strict-request-fields).
        chat_line("unknown", "x", max_tokens=3, frobnicate=1),
    ]
    uploaded = upload(client, tmp_path, lines)
    batch = wait(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h"))
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 2, 5)
    assert set(results(client, batch.output_file_id)) == {"ok", "unknown"}
    errors = results(client, batch.error_file_id)
    expected = {"empty": (400, "messages"), "negative": (400, "max_tokens"), "long": (400, "messages"),
                "stream": (400, "stream"), "model": (404, "model")}
    for custom_id, (status, param) in expected.items():
        line = errors[custom_id]
        assert line["response"]["status_code"] == status, line
        assert line["response"]["body"]["error"]["param"] == param, line
        assert line["error"]["message"] == line["response"]["body"]["error"]["message"]
    assert errors["long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"


@pytest.fixture(scope="module")
def small(server, tmp_path_factory):
    """The same engine behind an app with its own storage, 10 lines per batch at most."""
    from xlaserve.http.app import create_app
    from xlaserve.http.batches.runner import BatchRunner
    from xlaserve.http.batches.storage import Storage

    runner = BatchRunner(server.ctx, Storage(str(tmp_path_factory.mktemp("batches"))),
                         max_file_size=1 << 20, max_lines=10, concurrency=2)
    running = AppServer(create_app(server.ctx, batch_runner=runner), server.ctx)
    yield running
    running.close()


GOOD = json.dumps(chat_line("a", "hi", max_tokens=2))
INVALID_INPUTS = {
    "invalid_json_line": ([GOOD, "{not json"], 2),
    "invalid_encoding": ([GOOD, b'{"custom_id": "\xff"}'], 2),
    "duplicate_custom_id": ([GOOD, GOOD], 2),
    "invalid_request": ([GOOD, json.dumps(chat_line("b", "hi", url="/v1/completions"))], 2),
    "missing_body": ([json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"})], 1),
    "not_an_object": (["[1, 2]"], 1),
    "empty_file": ([""], None),
    "too_many_requests": ([json.dumps(chat_line(f"r{i}", "hi")) for i in range(11)], None),
}


@pytest.mark.parametrize("case", list(INVALID_INPUTS))
def test_an_invalid_input_file_fails_the_batch_naming_the_line(small, case):
    client = small.openai()
    lines, line_number = INVALID_INPUTS[case]
    content = b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n"
    uploaded = client.files.create(file=("input.jsonl", content), purpose="batch")
    batch = wait(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h"))
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    error = batch.errors.data[0]
    assert error.line == line_number and error.message
    if case in ("invalid_json_line", "invalid_encoding", "duplicate_custom_id", "empty_file", "too_many_requests"):
        assert error.code == case
    assert batch.errors.object == "list"


def test_bad_creates_and_unknown_ids(small, tmp_path):
    client = small.openai()
    batch_file = upload(client, tmp_path, [chat_line("a", "hi", max_tokens=1)])
    other = client.files.create(file=("notes.txt", b"x"), purpose="user_data")
    create = dict(input_file_id=batch_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(**{**create, "input_file_id": "file-nope"})
    for change, param in (({"input_file_id": other.id}, "input_file_id"), ({"endpoint": "/v1/embeddings"}, "endpoint"),
                          ({"completion_window": "1h"}, "completion_window"),
                          ({"metadata": {"k" * 65: "v"}}, "metadata")):
        with pytest.raises(openai.BadRequestError) as raised:
            client.batches.create(**{**create, **change})
        assert raised.value.body["param"] == param
    for call in (client.batches.retrieve, client.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call("batch_nope")
    response = httpx.post(small.base_url + "/v1/batches", json={**create, "extra": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "extra"
    done = wait(client, client.batches.create(**create))
    with pytest.raises(openai.BadRequestError, match="completed"):
        client.batches.cancel(done.id)


def test_list_is_newest_first_with_after_and_limit(small, tmp_path):
    client = small.openai()
    uploaded = upload(client, tmp_path, [{"custom_id": "a", "method": "POST", "url": "/completions",
                                          "body": {"model": MODEL, "prompt": "x", "max_tokens": 1}}])
    ids = [client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                 completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[:0:-1] and page.has_more
    assert [b.id for b in client.batches.list(after=ids[1], limit=100).data][:1] == [ids[0]]
    listed = [b.id for b in client.batches.list(limit=1)]  # the SDK pages with `after`
    assert listed[:3] == ids[::-1] and len(listed) == len(set(listed))
    with pytest.raises(openai.NotFoundError):
        client.batches.list(after="batch_nope")
    for batch_id in ids:
        assert wait(client, client.batches.retrieve(batch_id)).status == "completed"


def test_a_chat_request_is_not_queued_behind_a_running_batch(server, client, tmp_path):
    messages = [{"role": "user", "content": "Are you there?"}]
    alone = []
    for _ in range(3):
        start = time.perf_counter()
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **NO_EOS)
        alone.append(time.perf_counter() - start)
    requests = [chat_line(f"r{i}", f"Item {i}", max_tokens=16, **NO_EOS) for i in range(3000)]
    batch = client.batches.create(input_file_id=upload(client, tmp_path, requests).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 20:
        time.sleep(0.05)
    busy = []
    for _ in range(3):
        start = time.perf_counter()
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **NO_EOS)
        busy.append(time.perf_counter() - start)
        assert reply.usage.completion_tokens == 8
    running = client.batches.retrieve(batch.id)
    client.batches.cancel(batch.id)
    assert running.status == "in_progress" and running.request_counts.completed < 3000
    # Answered as a batch line would be, whatever the number of lines still queued: the
    # engine steps are bigger, but nothing waits for the 3000 lines.
    assert max(busy) < max(2.0, 10 * min(alone)), (alone, busy)
    wait(client, client.batches.retrieve(batch.id))
