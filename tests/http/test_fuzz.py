"""Fuzzing every route (issue 29, item 7; Anthropic's /v1/messages, issue 73): random JSON values
in every field of every body, and no 5xx, no hang, no neighbour's abort.

Each example starts from a valid body of its route and puts a random JSON value (None, bools,
ints up to -2**70 and 2**64, floats to 1e308, unicode and long text, lists, objects, or the field
removed) at one to three places, top-level fields (every field of the route's pydantic model, and
unknown ones) or nested ones (messages[0].content, response_format.json_schema.schema,
tools[0].function.parameters, stream_options, logit_bias keys and values, sampling_params.*).
Every answer must be < 500; a 4xx has OpenAI's error shape, its `param` one of the body's fields
(or the route's path and query names); a 200 stream ends with `data: [DONE]` and carries no
error event (on /v1/messages: Anthropic's error shape, a stream ending with message_stop and no
error event). Meanwhile a neighbour thread streams 64-token requests one after another: each must
end with finish_reason "length" and 64 tokens, whatever the fuzzed requests did. The same
fuzzing reaches every tool-call and reasoning parser through apps sharing the engine, the files
and batches routes (uploads, ids, list queries, batch input files of fuzzed lines), and bodies
that are not JSON objects. After all of it the server still answers.

What fuzzing found is kept as minimal repros in test_fuzz_found.py. The values are made in
fuzz_values.py; the valid bodies, the answer check and the neighbour are in fuzz_support.py.

Hypothesis runs derandomized (the same examples on every run), with no database and its caches
in a temporary folder.
"""
from __future__ import annotations

import dataclasses
import json
import time
import urllib.parse

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.http.conftest import AppServer
from tests.http.fuzz_support import (CHAT, CHAT_BASES, CHAT_PATHS, COMPLETION_BASES,  # noqa: F401
                                     COMPLETION_PATHS, FUZZ, GENERATE_BASES, GENERATE_PATHS,
                                     MESSAGES_BASES, MESSAGES_PATHS, PARAMETERS, check_answer,
                                     fields, fresh_connections, http, hypothesis_home, neighbour,
                                     post_json)
from tests.http.fuzz_values import NEW, PLAIN_EDGE_TEXTS, PLAIN_TEXT, mutated
from xlaserve.http.batches.files import UPLOAD_PURPOSES
from xlaserve.http.protocol import BatchRequest


# --- the JSON routes -----------------------------------------------------------------------------

@pytest.mark.parametrize("path,bases", [("/v1/chat/completions", CHAT_BASES),
                                        ("/v1/completions", COMPLETION_BASES),
                                        ("/generate", GENERATE_BASES),
                                        ("/v1/messages", MESSAGES_BASES)])
def test_the_valid_bodies_fuzzing_starts_from_are_answered(http, path, bases):
    for body in bases:
        response = http.post(path, json=body)
        assert response.status_code == 200, (body, response.text)
        check_answer(response, 0.0, body)


@pytest.mark.parametrize("path,bases,paths,examples", [
    ("/v1/chat/completions", CHAT_BASES, CHAT_PATHS, 300),
    ("/v1/completions", COMPLETION_BASES, COMPLETION_PATHS, 200),
    ("/generate", GENERATE_BASES, GENERATE_PATHS, 300),
    ("/v1/messages", MESSAGES_BASES, MESSAGES_PATHS, 200)])
def test_json_route_fuzz(http, neighbour, path, bases, paths, examples):
    @settings(FUZZ, max_examples=examples)
    @given(mutated(bases, paths))
    def fuzz(body):
        post_json(http, path, body)

    fuzz()
    neighbour.check()


# Tool-call and reasoning parsers: the same engine behind an app per pair (the fixture server
# has neither), so tools, tool_choice and chat_template_kwargs reach every parser.
PARSER_PAIRS = [("qwen25", "deepseek-v3"), ("llama3", "qwen3"), ("pythonic", "gpt-oss"),
                ("mistral", "kimi"), ("deepseekv31", "qwen3-thinking"), ("deepseekv3", "deepseek-r1"),
                ("gpt-oss", "gpt-oss")]  # the last with gpt-oss's Harmony chat format too


@pytest.fixture(scope="module")
def parser_clients(server, tmp_path_factory):
    from tests.http.harmony_support import harmony_chat
    from xlaserve.http.app import create_app

    apps = []
    for tool_call_parser, reasoning_parser in PARSER_PAIRS:
        harmony = harmony_chat(str(tmp_path_factory.mktemp("o200k"))) \
            if tool_call_parser == "gpt-oss" else None
        ctx = dataclasses.replace(server.ctx, tool_call_parser=tool_call_parser,
                                  reasoning_parser=reasoning_parser, harmony=harmony)
        apps.append(AppServer(create_app(ctx), ctx))
    clients = [fresh_connections(app.base_url) for app in apps]
    yield clients
    for client, app in zip(clients, apps):
        client.close()
        app.close()


def test_chat_completions_with_parsers_fuzz(parser_clients, neighbour):
    strict = {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": PARAMETERS, "strict": True}}]}

    @settings(FUZZ, max_examples=150)
    @given(st.sampled_from(range(len(PARSER_PAIRS))),
           mutated(CHAT_BASES + [strict, {**strict, "stream": True}], CHAT_PATHS))
    def fuzz(which, body):
        post_json(parser_clients[which], "/v1/chat/completions", body)

    fuzz()
    neighbour.check()


RAW_BODIES = [b"", b"{", b"NaN", b'{"max_tokens": NaN}', b'{"max_tokens": Infinity}', b"1e999",
              b"[" * 5000 + b"]" * 5000, b'{"a": ' * 2000 + b"1" + b"}" * 2000, b"\xff\xfe{}",
              b'"\\ud800"', b"null", b"[]", b'{"messages": [' + b"{}," * 3000 + b"{}]}"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate",
                                  "/v1/batches", "/v1/messages"])
def test_bodies_that_are_not_json_objects(http, path):
    for content in RAW_BODIES:
        for content_type in ("application/json", "text/plain"):
            start = time.monotonic()
            response = http.post(path, content=content, headers={"content-type": content_type})
            try:  # orjson: Python's json would hit the recursion limit in this thread
                sent = orjson.loads(content)
            except orjson.JSONDecodeError:
                sent = content
            check_answer(response, time.monotonic() - start, sent)
            assert response.status_code == 400, (content[:100], response.text)


# --- files and batches ---------------------------------------------------------------------------

BATCH_LINE = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def upload(client: httpx.Client, content: bytes, purpose: str = "batch") -> str:
    response = client.post("/v1/files", files={"file": ("in.jsonl", content)},
                           data={"purpose": purpose})
    assert response.status_code == 200, response.text
    return response.json()["id"]


@pytest.fixture(scope="module")
def batch_input(http) -> str:
    return upload(http, json.dumps(BATCH_LINE).encode() + b"\n")


def test_file_upload_fuzz(http, neighbour):
    names = st.sampled_from(["file", "purpose"]) | PLAIN_TEXT
    form_text = st.sampled_from(UPLOAD_PURPOSES) | PLAIN_TEXT | st.sampled_from(PLAIN_EDGE_TEXTS)

    @settings(FUZZ, max_examples=60)
    @given(file_field=names, filename=PLAIN_TEXT | st.sampled_from(PLAIN_EDGE_TEXTS),
           content=st.binary(max_size=300), fields=st.dictionaries(names, form_text, max_size=3),
           content_type=st.sampled_from(["multipart/form-data", None]))
    def fuzz(file_field, filename, content, fields, content_type):
        request = http.build_request("POST", "/v1/files", files={file_field: (filename, content)},
                                     data=fields)
        form = request.read()
        if content_type is None:  # the same bytes, but not said to be a form
            request = http.build_request("POST", "/v1/files", content=form,
                                         headers={"content-type": "application/octet-stream"})
        start = time.monotonic()
        response = http.send(request)
        check_answer(response, time.monotonic() - start, {**fields, file_field: filename})

    fuzz()
    neighbour.check()


BATCH_PATHS = fields(BatchRequest) + [("metadata", NEW), ("output_expires_after", NEW)]


def test_batch_create_fuzz(http, neighbour, batch_input):
    base = {"input_file_id": batch_input, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}

    @settings(FUZZ, max_examples=60)
    @given(mutated([base, {**base, "metadata": {"k": "v"}}], BATCH_PATHS))
    def fuzz(body):
        post_json(http, "/v1/batches", body)

    fuzz()
    neighbour.check()


def test_id_and_list_routes_fuzz(http, neighbour, batch_input):
    ids = PLAIN_TEXT | st.sampled_from(PLAIN_EDGE_TEXTS + [batch_input, "tiny", "file-", "batch_"])
    routes = st.sampled_from([("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"),
                              ("DELETE", "/v1/files/{}"), ("GET", "/v1/batches/{}"),
                              ("POST", "/v1/batches/{}/cancel"), ("GET", "/v1/models/{}")])
    query = st.dictionaries(st.sampled_from(["limit", "after", "order", "purpose"]) | PLAIN_TEXT,
                            PLAIN_TEXT | st.sampled_from(PLAIN_EDGE_TEXTS) | st.integers().map(str),
                            max_size=3)

    @settings(FUZZ, max_examples=100)
    @given(route=routes, item=ids, listing=st.sampled_from(["/v1/files", "/v1/batches"]), params=query)
    def fuzz(route, item, listing, params):
        method, template = route
        if method == "DELETE" and item == batch_input:
            item += "x"  # the other routes' input
        start = time.monotonic()
        response = http.request(method, template.format(urllib.parse.quote(item, safe="")))
        check_answer(response, time.monotonic() - start)
        start = time.monotonic()
        response = http.get(listing, params=params)
        check_answer(response, time.monotonic() - start)

    fuzz()
    neighbour.check()


def test_batch_input_file_fuzz(http, neighbour):
    """A batch whose input file holds fuzzed lines (request bodies as above, lines with their
    other fields fuzzed, or bytes) ends completed or failed, each line answered < 500."""
    routes = {"/v1/chat/completions": (CHAT_BASES, CHAT_PATHS),
              "/v1/completions": (COMPLETION_BASES, COMPLETION_PATHS)}

    def lines(endpoint: str):
        line = {**BATCH_LINE, "url": endpoint}
        return st.one_of(
            mutated(*routes[endpoint]).map(lambda body: {**line, "body": body}),
            mutated([line], [("custom_id",), ("method",), ("url",), ("body",), (NEW,), ()]))

    requests = st.sampled_from(sorted(routes)).flatmap(lambda endpoint: st.tuples(
        st.just(endpoint), st.lists(lines(endpoint), min_size=1, max_size=4)))

    @settings(FUZZ, max_examples=25)
    @given(requests, st.none() | st.binary(max_size=200))
    def fuzz(request, raw):
        endpoint, items = request
        for i, item in enumerate(items):  # unique custom_ids where they are strings
            if isinstance(item, dict) and isinstance(item.get("custom_id"), str):
                item["custom_id"] += str(i)
        content = raw if raw is not None else \
            b"".join(json.dumps(item, allow_nan=False).encode() + b"\n" for item in items)
        batch = http.post("/v1/batches", json={"input_file_id": upload(http, content),
                                               "endpoint": endpoint, "completion_window": "24h"})
        assert batch.status_code == 200, batch.text
        batch = batch.json()
        deadline = time.monotonic() + 60
        while batch["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
            batch = http.get(f"/v1/batches/{batch['id']}").json()
        errors = (batch["errors"] or {}).get("data", ())
        assert not any(e["code"] == "internal_error" for e in errors), batch
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id is not None:
                for line in http.get(f"/v1/files/{file_id}/content").text.splitlines():
                    result = json.loads(line)
                    assert result["response"]["status_code"] < 500, (content[:3000], result)

    fuzz()
    neighbour.check()


# --- after all of it -----------------------------------------------------------------------------

def test_the_server_still_serves_after_fuzzing(http, neighbour):
    neighbour.stop()
    neighbour.check()
    assert neighbour.finished >= 1
    assert http.get("/health").status_code == 200
    response = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
