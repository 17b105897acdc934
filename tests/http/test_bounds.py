"""Bad input anywhere is a 4xx naming the parameter, decided before the engine: a neighbour's
stream decoding at the same moment finishes with "length", and the server keeps serving.

The cases the issue found as an outside client: a `top_k` past int32 (a 500 that aborted every
live stream), `/generate` with `stop: 5` (no answer ever), `/generate` with `n: 100000000`
(unbounded memory). Then every bound of RequestLimits (one flag each), the queue bound, and the
`priority` flag. Bounds are lowered on the shared server's engine for a test (monkeypatch) rather
than starting a server per flag.
"""
import contextlib
import dataclasses
import threading
import time

import httpx
import pytest

from tests.http.test_errors import OK_CHAT, _assert_openai_error

OK_COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
OK_GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@contextlib.contextmanager
def neighbour_stream(server):
    """Another client's stream decoding while the body runs; it must end with finish "length"."""
    reasons, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=120, json={
                **OK_CHAT, "max_tokens": 48, "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                started.set()
                if line.startswith("data: {") and '"finish_reason":"length"' in line:
                    reasons.append("length")
                elif line.startswith("data: {") and '"error"' in line:
                    reasons.append(line)

    thread = threading.Thread(target=stream)
    thread.start()
    started.wait(60)
    try:
        yield
    finally:
        thread.join(120)
    assert reasons == ["length"], reasons


def _limits(monkeypatch, server, **bounds):
    core = server.ctx.engine.core
    monkeypatch.setattr(core, "limits", dataclasses.replace(core.limits, **bounds))


ISSUE_CASES = [
    ("/v1/chat/completions", {**OK_CHAT, "top_k": 2147483648}, "top_k"),
    ("/v1/completions", {**OK_COMPLETION, "top_k": 2**63}, "top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "stop": 5}},
     "sampling_params.stop"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "n": 100000000}},
     "sampling_params.n"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 2**40}}, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}},
     "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2.5}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"5": "x"}}},
     "sampling_params.logit_bias"),
    ("/generate", {"text": "hi", "sampling_params": {"n": True}}, "sampling_params.n"),
    ("/generate", {"text": "hi", "sampling_params": {"no_such_knob": 1}}, "sampling_params"),
    ("/generate", {"text": "hi", "sampling_params": "fast"}, "sampling_params"),
    ("/generate", {"text": [], "sampling_params": {}}, "text"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"skip_special_tokens": "yes"}},
     "sampling_params.skip_special_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "n": 129}, "n"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": ["a", "b", "c"], "n": 100}, "n"),
    ("/v1/chat/completions", {**OK_CHAT, "stop": [str(i) for i in range(17)]}, "stop"),
    ("/v1/chat/completions", {**OK_CHAT, "stop": "x" * 257}, "stop"),
    ("/v1/chat/completions", {**OK_CHAT, "logit_bias": {str(i): 1 for i in range(301)}},
     "logit_bias"),
    ("/v1/chat/completions", {**OK_CHAT, "seed": -2**64}, "seed"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [
        {**WEATHER, "function": {**WEATHER["function"], "name": f"f{i}"}} for i in range(129)]},
     "tools"),
    ("/v1/chat/completions", {**OK_CHAT, "regex": "a" * (256 * 1024 + 1)}, "regex"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "priority": 5}, "priority"),
]


@pytest.mark.parametrize("route,body,param", ISSUE_CASES,
                         ids=[f"{c[0]}:{c[2]}:{i}" for i, c in enumerate(ISSUE_CASES)])
def test_bad_values_are_a_400_naming_the_field_and_the_neighbour_streams_on(server, route, body,
                                                                           param):
    with neighbour_stream(server):
        response = httpx.post(server.base_url + route, json=body, timeout=30)
        _assert_openai_error(response, 400, param)
    ok = {"/generate": OK_GENERATE, "/v1/completions": OK_COMPLETION}.get(route, OK_CHAT)
    assert httpx.post(server.base_url + route, json=ok, timeout=30).status_code == 200


def test_bounds_lowered_by_their_flags(server, monkeypatch):
    _limits(monkeypatch, server, max_n=2, max_sequences_per_request=3, max_stop_sequences=1,
            max_stop_sequence_length=3, max_tools=1, max_constraint_size=100,
            max_prompt_logprob_entries=50)
    url = server.base_url
    cases = [
        ("/v1/chat/completions", {**OK_CHAT, "n": 3}, "n", "--max-n"),
        ("/v1/completions", {**OK_COMPLETION, "prompt": ["a", "b"], "n": 2}, "n",
         "--max-sequences-per-request"),
        ("/v1/completions", {**OK_COMPLETION, "prompt": ["a", "b", "c", "d"]}, "prompt",
         "--max-sequences-per-request"),
        ("/v1/chat/completions", {**OK_CHAT, "stop": ["a", "b"]}, "stop", "--max-stop-sequences"),
        ("/v1/chat/completions", {**OK_CHAT, "stop": "abcd"}, "stop", "--max-stop-sequence-length"),
        ("/v1/chat/completions", {**OK_CHAT, "tools": [WEATHER, {**WEATHER, "function": {
            **WEATHER["function"], "name": "other"}}]}, "tools", "--max-tools"),
        ("/v1/chat/completions", {**OK_CHAT, "tools": [{**WEATHER, "function": {
            **WEATHER["function"], "description": "d" * 200, "parameters": {
                "type": "object", "description": "d" * 200}}}]}, "tools", "--max-constraint-size"),
        ("/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "description": "d" * 200}}}},
         "response_format", "--max-constraint-size"),
        ("/v1/completions", {**OK_COMPLETION, "prompt": "word " * 60, "echo": True, "logprobs": 1},
         "echo", "--max-prompt-logprob-entries"),
        ("/generate", {"text": "word " * 60, "return_logprob": True, "logprob_start_len": 0},
         "logprob_start_len", "--max-prompt-logprob-entries"),
        ("/generate", {"text": ["a", "b"], "sampling_params": {"n": 2}}, "n",
         "--max-sequences-per-request"),
    ]
    for route, body, param, flag in cases:
        error = _assert_openai_error(httpx.post(url + route, json=body, timeout=30), 400, param)
        assert flag in error["message"], (route, error)
    # Within the bounds, the same kinds of request are served.
    assert httpx.post(url + "/v1/chat/completions", timeout=30,
                      json={**OK_CHAT, "n": 2, "stop": "ab", "tools": [WEATHER]}).status_code == 200


def test_a_slow_grammar_compile_is_a_400(server, monkeypatch):
    _limits(monkeypatch, server, grammar_compile_timeout=1e-9)
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                          json={**OK_CHAT, "regex": "(never compiled before: [0-9]{3})"})
    error = _assert_openai_error(response, 400, "regex")
    assert "--grammar-compile-timeout" in error["message"]


def test_a_full_queue_is_a_503_with_retry_after(server, monkeypatch):
    _limits(monkeypatch, server, max_queued_requests=1)  # idle: nothing waits, so this is served
    assert httpx.post(server.base_url + "/v1/chat/completions", json=OK_CHAT,
                      timeout=30).status_code == 200
    _limits(monkeypatch, server, max_queued_requests=0)
    for route, body in [("/v1/chat/completions", OK_CHAT), ("/generate", OK_GENERATE)]:
        response = httpx.post(server.base_url + route, json=body, timeout=30)
        error = _assert_openai_error(response, 503)
        assert error["code"] == "queue_full" and response.headers["retry-after"] == "1"


def test_priority_is_honoured_only_with_its_flag(server, monkeypatch):
    error = _assert_openai_error(httpx.post(server.base_url + "/v1/completions", timeout=30,
                                            json={**OK_COMPLETION, "priority": 1}), 400, "priority")
    assert "--enable-priority-scheduling" in error["message"]
    monkeypatch.setattr(server.ctx.engine.server_args, "enable_priority_scheduling", True)
    assert httpx.post(server.base_url + "/v1/completions", timeout=30,
                      json={**OK_COMPLETION, "priority": 1}).status_code == 200


def test_a_batch_line_waits_out_a_full_queue_instead_of_failing(server, client, monkeypatch,
                                                                tmp_path):
    from tests.http.test_batches import chat_line, results, upload, wait

    _limits(monkeypatch, server, max_queued_requests=0)  # every submission is refused for now
    uploaded = upload(client, tmp_path, [chat_line("queued", "hello", max_tokens=2)])
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    time.sleep(2.5)  # the line meets the full queue a few times
    assert client.batches.retrieve(batch.id).status == "in_progress"
    monkeypatch.undo()
    batch = wait(client, batch)
    assert batch.status == "completed" and batch.request_counts.completed == 1
    assert results(client, batch.output_file_id)["queued"]["response"]["status_code"] == 200
