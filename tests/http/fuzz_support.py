"""What the fuzz tests (tests/http/test_fuzz*.py) share: each route's valid bodies and the places
to fuzz in them, the check every answer must pass, the neighbour stream that must be untouched,
and their fixtures (imported by name into each test module)."""
from __future__ import annotations

import dataclasses
import json
import reprlib
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, configuration, settings

from tests.http.fuzz_values import APPEND, NEW
from xlaserve.http.protocol import (BatchRequest, ChatCompletionRequest, CompletionRequest,
                                    GenerateRequest)
from xlaserve.http.messages.protocol import MessagesRequest
from xlaserve.http.pooling.classify import ClassifyRequest
from xlaserve.runtime.sampling.params import SamplingParams

REQUEST_TIMEOUT_S = 30.0  # an answer later than this is a hang
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def hypothesis_home(tmp_path_factory):
    """Hypothesis's caches (unicode tables, constants it mines from the source) in a temporary
    folder, not a .hypothesis folder in the checkout."""
    configuration.set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    configuration.set_hypothesis_home_dir(None)


def fields(model) -> list[tuple]:
    return [(name,) for name in model.model_fields] + [(NEW,), ()]


# --- the routes' valid bodies and the places to fuzz ---------------------------------------------

USER = [{"role": "user", "content": "hi"}]
PARAMETERS = {"type": "object", "properties": {"x": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": PARAMETERS}}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 2}
CHAT_BASES = [
    CHAT,
    {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}},
    {**CHAT, "tools": TOOLS, "tool_choice": "required"},
    {**CHAT, "tools": TOOLS, "stream": True,
     "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {**CHAT, "logit_bias": {"5": 1.0}, "logprobs": True, "top_logprobs": 2, "stop": ["x"],
     "seed": 1, "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "stop_token_ids": [7]},
    {**CHAT, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "hi", "name": "u"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": '{"x": "a"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]},
]
CHAT_PATHS = fields(ChatCompletionRequest) + [
    ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
    ("messages", 0, "content", 0, "type"), ("messages", 0, "content", 0, "text"),
    ("messages", 0, "name"), ("messages", 0, NEW), ("messages", APPEND),
    ("messages", 2, "tool_calls"), ("messages", 2, "tool_calls", 0, "function", "arguments"),
    ("messages", 2, "tool_calls", 0, NEW), ("messages", 3, "tool_call_id"),
    ("response_format", "type"), ("response_format", "json_schema"),
    ("response_format", "json_schema", "schema"),
    ("response_format", "json_schema", "schema", "properties", "a"),
    ("response_format", "json_schema", "name"), ("response_format", "schema"), ("response_format", NEW),
    ("tools", 0), ("tools", 0, "type"), ("tools", 0, "function"), ("tools", 0, "function", "name"),
    ("tools", 0, "function", "parameters"), ("tools", 0, "function", "parameters", "properties", "x"),
    ("tools", 0, "function", "strict"), ("tools", APPEND), ("tool_choice", "function", "name"),
    ("stream_options", "include_usage"), ("stream_options", "continuous_usage_stats"),
    ("stream_options", NEW), ("logit_bias", NEW), ("logit_bias", "5"), ("stop", 0),
    ("stop_token_ids", 0), ("chat_template_kwargs", NEW), ("metadata", NEW)]

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
COMPLETION_BASES = [
    COMPLETION,
    {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "echo": True},
    {**COMPLETION, "prompt": [1, 2, 3], "logprobs": 2, "echo": True, "n": 2, "best_of": 2},
    {**COMPLETION, "prompt": [[1, 2], [3]], "logit_bias": {"5": -1}, "seed": 3, "stop": "x"},
    {**COMPLETION, "prompt": ["a", "b"], "regex": "[ab]+", "stream": True},
]
COMPLETION_PATHS = fields(CompletionRequest) + [
    ("prompt", 0), ("prompt", 0, 0), ("prompt", APPEND), ("stream_options", "include_usage"),
    ("stream_options", "continuous_usage_stats"), ("stream_options", NEW), ("logit_bias", NEW),
    ("logit_bias", "5"), ("response_format", "type"), ("response_format", "json_schema", "schema"),
    ("response_format", "schema"), ("stop", 0), ("stop_token_ids", 0)]

SAMPLING = {"max_new_tokens": 2}
GENERATE_BASES = [
    {"text": "hi", "sampling_params": SAMPLING},
    {"text": "hi", "sampling_params": {**SAMPLING, "temperature": 0}, "stream": True},
    {"input_ids": [1, 2, 3], "sampling_params": {**SAMPLING, "n": 2, "logit_bias": {"5": 1.0},
                                                 "stop": ["x"], "stop_token_ids": [7], "seed": 1},
     "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0},
    {"input_ids": [[1, 2], [3]], "sampling_params": [SAMPLING, {**SAMPLING, "top_k": 3}],
     "rid": ["a", "b"]},
    {"text": ["hi", "yo"], "sampling_params": {**SAMPLING, "json_schema": '{"type": "object"}'}},
]
GENERATE_PATHS = fields(GenerateRequest) + [
    ("sampling_params", f.name) for f in dataclasses.fields(SamplingParams)] + [
    ("sampling_params", "n"), ("sampling_params", NEW), ("sampling_params", "logit_bias", NEW),
    ("sampling_params", "stop", 0), ("sampling_params", 0), ("sampling_params", 0, "max_new_tokens"),
    ("sampling_params", 1, NEW), ("sampling_params", APPEND), ("text", 0), ("text", APPEND),
    ("input_ids", 0), ("input_ids", 0, 0), ("input_ids", APPEND), ("rid", 0)]

MESSAGE = {"model": "tiny", "messages": USER, "max_tokens": 2}
ANTHROPIC_TOOL = {"name": "f", "input_schema": PARAMETERS}
MESSAGES_BASES = [
    MESSAGE,
    {**MESSAGE, "stream": True, "system": [{"type": "text", "text": "be brief",
                                            "cache_control": {"type": "ephemeral"}}]},
    {**MESSAGE, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "f"},
     "stream": True},
    {**MESSAGE, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["x"],
     "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"}},
    {**MESSAGE, "tools": [ANTHROPIC_TOOL], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t", "signature": "s"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": "a"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]},
]
MESSAGES_PATHS = fields(MessagesRequest) + [
    ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
    ("messages", 0, "content", 0), ("messages", 0, "content", 0, "type"),
    ("messages", 0, "content", 0, "text"), ("messages", 0, "content", 0, NEW),
    ("messages", 0, NEW), ("messages", APPEND), ("messages", 1, "content", 1, "input"),
    ("messages", 1, "content", 1, "id"), ("messages", 1, "content", 0, "thinking"),
    ("messages", 2, "content", 0, "content"), ("messages", 2, "content", 0, "tool_use_id"),
    ("system", 0, "text"), ("system", 0, NEW), ("tools", 0), ("tools", 0, "name"),
    ("tools", 0, "input_schema"), ("tools", 0, "type"), ("tools", 0, NEW), ("tools", APPEND),
    ("tool_choice", "type"), ("tool_choice", "name"), ("tool_choice", NEW),
    ("thinking", "type"), ("thinking", "budget_tokens"), ("metadata", NEW),
    ("stop_sequences", 0)]

# The 400s that name no field: the body as a whole is at fault.
WHOLE_BODY_ERRORS = ("the request body is not valid JSON", "Input should be a valid dictionary",
                     "the request body must be a JSON object", "upload the file as multipart")
# What a 4xx's `param` may name: the route's body fields, its path and query names, or a key sent.
ROUTE_PARAMS = {"file_id", "batch_id", "model", "limit", "order", "after", "purpose", "file"}
BODY_FIELDS = {"/v1/chat/completions": set(ChatCompletionRequest.model_fields),
               "/v1/completions": set(CompletionRequest.model_fields),
               "/generate": set(GenerateRequest.model_fields),
               "/v1/batches": set(BatchRequest.model_fields),
               "/classify": set(ClassifyRequest.model_fields),
               "/pooling": set(ClassifyRequest.model_fields)}


# --- the checks ----------------------------------------------------------------------------------

SHOW = reprlib.Repr()  # bodies in messages: bounded, however deep or long
SHOW.maxlevel, SHOW.maxdict, SHOW.maxlist, SHOW.maxstring, SHOW.maxother = 6, 30, 30, 300, 300


def check_answer(response: httpx.Response, elapsed: float, sent=None) -> None:
    """< 500 in time; a 4xx in OpenAI's shape whose `param` names one of the route's fields (or
    a key of `sent`); a 200 stream read to its [DONE] without an error event."""
    what = f"{response.request.method} {response.request.url.path} {SHOW.repr(sent)} -> " \
           f"{response.status_code} {response.text[:1500]}"
    assert response.status_code < 500, what
    assert elapsed < REQUEST_TIMEOUT_S, f"{elapsed:.1f} s: " + what
    if response.request.url.path.startswith("/v1/messages"):
        return check_anthropic_answer(response, what)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, what
        assert isinstance(error["message"], str) and error["message"], what
        param = error["param"]
        if response.status_code == 400:
            assert param is not None or error["message"].startswith(WHOLE_BODY_ERRORS), what
        if param is not None:
            known = ROUTE_PARAMS | BODY_FIELDS.get(response.request.url.path, set()) \
                | (set(sent) if isinstance(sent, dict) else set())
            assert any(param in (name, name[:200]) or param.startswith((name + ".", name + "["))
                       for name in known), what
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in response.text.split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", what
        for event in events[:-1]:
            assert "error" not in json.loads(event.removeprefix("data: ")), what


def check_anthropic_answer(response: httpx.Response, what: str) -> None:
    """The Messages API's: a 4xx in Anthropic's shape; a 200 stream ends with message_stop and
    carries no error event."""
    if response.status_code >= 400:
        error = response.json()
        assert set(error) == {"type", "error"} and error["type"] == "error", what
        assert set(error["error"]) == {"type", "message"} and error["error"]["message"], what
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e.split("\n")[0] for e in response.text.split("\n\n") if e]
        assert events and events[-1] == "event: message_stop", what
        assert "event: error" not in events, what


def post_json(client: httpx.Client, path: str, body) -> None:
    content = json.dumps(body, allow_nan=False).encode()
    start = time.monotonic()
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    check_answer(response, time.monotonic() - start, body)


def fresh_connections(base_url: str) -> httpx.Client:
    """A client that opens a connection per request: the server closes one after a 500, which a
    kept-alive one would report on the next request as a reset."""
    return httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S,
                        limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture(scope="module")
def http(server):
    with fresh_connections(server.base_url) as client:
        yield client


class Neighbour:
    """A thread that streams 64-token chat requests one after another until stopped; each must
    end with "length" after 64 tokens, whatever the fuzzed requests beside it do."""

    BODY = {**CHAT, "max_tokens": 64, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.finished = 0
        self.failures: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fuzz-neighbour", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stopping.is_set():
                try:
                    self._one(client)
                except Exception as error:  # reported by the tests, not lost in the thread
                    self.failures.append(f"{type(error).__name__}: {error}")

    def _one(self, client: httpx.Client) -> None:
        response = client.post("/v1/chat/completions", json=self.BODY)
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        if response.status_code != 200 or events[-1:] != ["[DONE]"]:
            raise AssertionError(f"{response.status_code} {response.text[-500:]}")
        chunks = [json.loads(e) for e in events[:-1]]
        reasons = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]
                   if c["finish_reason"]]
        usage = chunks[-1]["usage"]
        if reasons != ["length"] or usage["completion_tokens"] != 64 \
                or any("error" in c for c in chunks):
            raise AssertionError(f"finish {reasons}, usage {usage}: {response.text[-500:]}")
        self.finished += 1

    def check(self) -> None:
        assert not self.failures, self.failures[:3]

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=2 * REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def neighbour(server):
    running = Neighbour(server.base_url)
    yield running
    running.stop()
