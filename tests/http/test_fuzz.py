"""Fuzzing every route (issue 29, item 7): random JSON values in every field of every body, and no
5xx, no hang, no neighbour's abort.

Each example starts from a valid body of its route and puts a random JSON value (None, bools,
ints up to -2**70 and 2**64, floats to 1e308, unicode and long text, lists, objects, or the field
removed) at one to three places, top-level fields (every field of the route's pydantic model, and
unknown ones) or nested ones (messages[0].content, response_format.json_schema.schema,
tools[0].function.parameters, stream_options, logit_bias keys and values, sampling_params.*).
Every answer must be < 500; a 4xx has OpenAI's error shape, its `param` one of the body's fields
(or the route's path and query names); a 200 stream ends with `data: [DONE]` and carries no
error event. Meanwhile a neighbour thread streams 64-token requests one after another: each must
end with finish_reason "length" and 64 tokens, whatever the fuzzed requests did. The same
fuzzing reaches every tool-call and reasoning parser through apps sharing the engine, the files
and batches routes (uploads, ids, list queries, batch input files of fuzzed lines), and bodies
that are not JSON objects. After all of it the server still answers.

What fuzzing found is kept as minimal repros (`FOUND`), run against a server in a process of its
own (see `isolated`), each with where it was fixed.

Hypothesis runs derandomized (the same examples on every run), with no database and its caches
in a temporary folder.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import reprlib
import threading
import time
import urllib.parse

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, configuration, given, settings
from hypothesis import strategies as st

from tests.http.conftest import SERVER_DEFAULTS, AppServer, launch_server_process
from xlaserve.http.batches.files import UPLOAD_PURPOSES
from xlaserve.http.protocol import (BatchRequest, ChatCompletionRequest, CompletionRequest,
                                    GenerateRequest)
from xlaserve.sampling.params import SamplingParams

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


# --- random JSON values --------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2, 3, 20, 21, 64, 129, 257, 511, 512, 513, 49151, 49152, 2**31 - 1, 2**31,
             -2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -2**63 - 1, 2**64, -2**70, 10**30]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, -2.0, 2.5, 100.0, 100.5, 1e-300, 5e-324, 1e308,
               -1e308, 1.7976931348623157e308]
EDGE_TEXTS = ["", " ", "tiny", "default", "auto", "none", "required", "text", "json_object",
              "json_schema", "structural_tag", "function", "object", "string", "user", "assistant",
              "system", "tool", "developer", "batch", "24h", "/v1/chat/completions",
              "/chat/completions", "/v1/completions", "5", "-1", "49152", "1e3",
              "99999999999999999999", "<|im_end|>", "<|endoftext|>", "<tool_call>", "é 🙂 中文",
              "\x00", "\ud800", "\r\n", "../../etc/passwd", "[a-", "(a*)*b", 'root ::= "a"',
              '{"type": "object"}', "{{ messages }}", "{% for x in y %}", "a" * 3000,
              "hello world " * 300]  # over the context
PLAUSIBLE = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "pattern": "[a-"},
    {"type": "array", "minItems": 2**31},
    {"$ref": "#"},
    {"type": "function", "function": {"name": "f"}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
    [{"type": "function", "function": {"name": "g"}}],
    [{"role": "user", "content": "hi"}],
    [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    {"type": "json_object"},
    {"include_usage": True, "continuous_usage_stats": True},
    {"5": 100, "49151": -100},
    [1, 2, 3],
    [[1, 2], [3]],
    ["a", "b"],
    {"max_new_tokens": 2, "n": 2},
]
SCHEMA_KEYWORDS = ["type", "properties", "items", "prefixItems", "required", "enum", "const",
                   "anyOf", "oneOf", "allOf", "not", "$ref", "$defs", "additionalProperties",
                   "patternProperties", "minLength", "maxLength", "pattern", "format", "minimum",
                   "maximum", "exclusiveMinimum", "multipleOf", "minItems", "maxItems",
                   "uniqueItems", "minProperties", "default"]
SCHEMA_TYPES = ["object", "string", "integer", "number", "boolean", "array", "null"]
DELETE = object()  # a value that removes the field
NEW = object()  # a path step: a random key
APPEND = object()  # a path step: a new last item of a list


def _scalars():
    return st.one_of(
        st.none(), st.booleans(), st.integers(-3, 70), st.integers(), st.sampled_from(EDGE_INTS),
        st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EDGE_FLOATS),
        st.text(max_size=12), st.sampled_from(EDGE_TEXTS))


JSON_VALUES = st.recursive(
    _scalars() | st.sampled_from(PLAUSIBLE),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(["type", "name", "schema"]), children,
                      max_size=4),
    max_leaves=10)
VALUES = st.one_of(JSON_VALUES, st.just(DELETE))
# JSON schemas made of schema keywords, for the fields the grammar backend compiles.
SCHEMAS = st.recursive(
    st.booleans() | st.fixed_dictionaries(
        {"type": st.sampled_from(SCHEMA_TYPES) | st.lists(st.sampled_from(SCHEMA_TYPES), max_size=3)}),
    lambda schemas: st.dictionaries(
        st.sampled_from(SCHEMA_KEYWORDS),
        schemas | _scalars() | st.lists(schemas, max_size=3)
        | st.dictionaries(st.text(max_size=4), schemas, max_size=3), max_size=4),
    max_leaves=12)
REGEXES = st.text(alphabet="ab()[]{}*+?|\\^$.-,0123456789dwsPZz<>=!:", max_size=16)
EBNFS = st.sampled_from(['root ::= "a" | "b"', "root ::= root", "root ::= x", 'root ::= "a"*',
                         'root ::= [a-', "", "root ::= %json {}", 'root ::= "x" root']) \
    | st.text(alphabet='root:=|"ab*+?()[]%{} \n', max_size=30)
STRUCTURAL_TAGS = st.builds(
    lambda begin, end, schema, triggers: json.dumps(
        {"structures": [{"begin": begin, "schema": schema, "end": end}], "triggers": triggers}),
    st.sampled_from(["<a>", "<tool_call>", ""]) | st.text(max_size=6),
    st.sampled_from(["</a>", ""]) | st.text(max_size=6), SCHEMAS,
    st.lists(st.sampled_from(["<a", "<tool_call>", ""]) | st.text(max_size=4), max_size=2))
# Text httpx can put in a URL or a form (no lone surrogates; JSON bodies carry them escaped).
PLAIN_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
PLAIN_EDGE_TEXTS = [t for t in EDGE_TEXTS if t != "\ud800"]
KEYS = st.text(max_size=12) | st.sampled_from(
    ["5", "0", "-1", "49151", "49152", "1e3", "0x10", " 7", "٣", "99999999999999999999",
     "99999999999999999999999", "type", "n", "seed"])


def put(body, path: tuple, value):
    """`body` with `value` at `path` (dicts on the way are made; a path through anything else
    leaves the body as it is); DELETE removes the field."""
    if not path:
        return body if value is DELETE else value
    node = body
    for key in path[:-1]:
        if isinstance(node, dict) and isinstance(key, str):
            node = node.setdefault(key, {})
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return body
    key = path[-1]
    if isinstance(node, list) and key is APPEND:
        if value is not DELETE:
            node.append(value)
    elif isinstance(node, dict) and isinstance(key, str) or \
            isinstance(node, list) and isinstance(key, int) and key < len(node):
        if value is DELETE:
            node.pop(key, None) if isinstance(node, dict) else node.pop(key)
        else:
            node[key] = value
    return body


def get(body, path: tuple):
    """The value at `path`, or DELETE where there is none."""
    for key in path:
        if isinstance(body, dict) and isinstance(key, str) and key in body \
                or isinstance(body, list) and isinstance(key, int) and key < len(body):
            body = body[key]
        else:
            return DELETE
    return body


def like(value):
    """Values of `value`'s JSON type, edges included: what passes the type check and tests the
    range checks behind it."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(-3, 70) | st.integers() | st.sampled_from(EDGE_INTS)
    if isinstance(value, float):
        return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(EDGE_FLOATS) \
            | st.sampled_from(EDGE_INTS)
    if isinstance(value, str):
        return st.text(max_size=30) | st.sampled_from(EDGE_TEXTS)
    if isinstance(value, list) and value:
        return st.lists(like(value[0]), max_size=5)
    return JSON_VALUES


def for_field(name, current):
    """Values made for what the field is: schemas, regexes, grammars, structural tags."""
    if name in ("schema", "parameters"):
        return SCHEMAS
    if name == "json_schema":
        return SCHEMAS.map(json.dumps) if isinstance(current, str) or current is DELETE \
            else st.fixed_dictionaries({"name": st.just("x"), "schema": SCHEMAS})
    if name == "logit_bias":  # around the engine's widths (MAX_LOGIT_BIAS, its padding)
        return st.sampled_from([63, 64, 65, 128, 129, 256, 257, 300, 301]).map(
            lambda n: {str(i): 1.0 for i in range(n)})
    if name == "stop_token_ids":
        return st.sampled_from([63, 64, 65]).map(lambda n: list(range(100, 100 + n)))
    if name == "stop":
        return st.sampled_from([(16, 256), (17, 1), (1, 257)]).map(lambda nk: ["s" * nk[1]] * nk[0])
    if name == "regex":
        return REGEXES
    if name == "ebnf":
        return EBNFS
    if name == "structural_tag":
        return STRUCTURAL_TAGS
    return st.nothing()


@st.composite
def mutated(draw, bases: list, paths: list):
    """A copy of one of `bases` with random values at one to three of `paths`: as often values
    of the type already there as any JSON value."""
    body = copy.deepcopy(draw(st.sampled_from(bases)))
    for path in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
        path = tuple(draw(KEYS) if step is NEW else step for step in path)
        current = get(body, path)
        typed = like(current) if current is not DELETE and current is not None else JSON_VALUES
        body = put(body, path, draw(for_field(path[-1] if path else None, current) | typed | VALUES))
    return body


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

# The 400s that name no field: the body as a whole is at fault.
WHOLE_BODY_ERRORS = ("the request body is not valid JSON", "Input should be a valid dictionary",
                     "the request body must be a JSON object", "upload the file as multipart")
# What a 4xx's `param` may name: the route's body fields, its path and query names, or a key sent.
ROUTE_PARAMS = {"file_id", "batch_id", "model", "limit", "order", "after", "purpose", "file"}
BODY_FIELDS = {"/v1/chat/completions": set(ChatCompletionRequest.model_fields),
               "/v1/completions": set(CompletionRequest.model_fields),
               "/generate": set(GenerateRequest.model_fields),
               "/v1/batches": set(BatchRequest.model_fields)}


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


# --- the JSON routes -----------------------------------------------------------------------------

@pytest.mark.parametrize("path,bases", [("/v1/chat/completions", CHAT_BASES),
                                        ("/v1/completions", COMPLETION_BASES),
                                        ("/generate", GENERATE_BASES)])
def test_the_valid_bodies_fuzzing_starts_from_are_answered(http, path, bases):
    for body in bases:
        response = http.post(path, json=body)
        assert response.status_code == 200, (body, response.text)
        check_answer(response, 0.0, body)


@pytest.mark.parametrize("path,bases,paths,examples", [
    ("/v1/chat/completions", CHAT_BASES, CHAT_PATHS, 300),
    ("/v1/completions", COMPLETION_BASES, COMPLETION_PATHS, 200),
    ("/generate", GENERATE_BASES, GENERATE_PATHS, 300)])
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
                ("mistral", "kimi"), ("deepseekv31", "qwen3-thinking"), ("deepseekv3", "deepseek-r1")]


@pytest.fixture(scope="module")
def parser_clients(server):
    from xlaserve.http.app import create_app

    apps = []
    for tool_call_parser, reasoning_parser in PARSER_PAIRS:
        ctx = dataclasses.replace(server.ctx, tool_call_parser=tool_call_parser,
                                  reasoning_parser=reasoning_parser)
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
                                  "/v1/batches"])
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


# --- what fuzzing found: each minimal repro, kept ----------------------------------------------

def _nested(depth: int, leaf: str = "{}") -> str:
    return '{"a": ' * depth + leaf + "}" * depth


def _chat_with(fields: str) -> bytes:
    return ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            + fields + "}").encode()


def _generate_with(sampling: dict) -> bytes:
    return json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2, **sampling}}).encode()


TOOL = '"tools": [{"type": "function", "function": {"name": "f"}}]'
FOUND = [
    # Fixed (chat_template.py): arguments nested past what json parses were a RecursionError.
    ("/v1/chat/completions", (
        '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "assistant", "tool_calls": '
        '[{"id": "1", "type": "function", "function": {"name": "f", "arguments": '
        + json.dumps(_nested(1000)) + "}}]}]}").encode()),
    # Fixed (sampling/grammar.py): llguidance refuses a boolean schema with options, and the
    # Infinity / NaN that Python's json reads: ValueError, a 500.
    ("/generate", _generate_with({"json_schema": "false"})),
    ("/v1/chat/completions", _chat_with('"json_schema": "true"')),
    ("/generate", _generate_with({"json_schema": '{"type": "string", "minLength": 1e400}'})),
    ("/generate", _generate_with({"json_schema": '{"type": "integer", "maximum": NaN}'})),
    # Fixed (sampling/grammar.py closed_objects, its json.loads): a schema nested 500 deep is a
    # RecursionError, a 500.
    ("/v1/chat/completions", _chat_with('"response_format": {"type": "json_schema", "json_schema": '
                                        '{"name": "x", "schema": ' + _nested(500) + "}}")),
    ("/generate", _generate_with({"json_schema": _nested(500)})),
    ("/generate", _generate_with({"json_schema": _nested(1000)})),
    ("/generate", _generate_with({"structural_tag": json.dumps({"structures": [
        {"begin": "<a>", "schema": json.loads(_nested(500)), "end": "</a>"}], "triggers": ["<a"]})})),
    # Fixed (http/serving.py response_format_constraint, http/parsing/tools.py check_tools: json.dumps):
    # nested 1000 deep, a RecursionError before the grammar.
    ("/v1/chat/completions", _chat_with(
        '"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": '
        + _nested(1000) + ', "end": "</a>"}], "triggers": ["<a"]}')),
    ("/v1/chat/completions", _chat_with('"tools": [{"type": "function", "function": {"name": "f", '
                                        '"parameters": ' + _nested(1000) + "}}]")),
    # Fixed (http/parsing/tools.py tool_choice_of): an unhashable name is a TypeError, a 500.
    ("/v1/chat/completions", _chat_with(TOOL + ', "tool_choice": {"type": "function", "function": '
                                                '{"name": []}}')),
    # Fixed (runtime: SamplingParams.validate allows MAX_LOGIT_BIAS=300 entries, the sampler pads
    # to a power of two): 257 to 300 entries are a 400 with the sampler's words and no param.
    ("/v1/chat/completions",
     _chat_with('"logit_bias": ' + json.dumps({str(i): 1 for i in range(257)}))),
    # Fixed (http/serving.py Generation): the engine's InvalidSamplingParam keeps its bare name
    # on /generate ("stop_token_ids", not "sampling_params.stop_token_ids").
    ("/generate", _generate_with({"stop_token_ids": list(range(100, 164))})),
    # Fixed (/generate): an empty prompt and a prompt past the context name no field.
    ("/generate", json.dumps({"text": "", "sampling_params": {"max_new_tokens": 2}}).encode()),
    ("/generate",
     json.dumps({"input_ids": [1] * 512, "sampling_params": {"max_new_tokens": 1}}).encode()),
    # Fixed (http/serving.py context_error): a completions prompt past the context names
    # "messages", a chat field.
    ("/v1/completions", json.dumps({"prompt": "hello world " * 300, "max_tokens": 1}).encode()),
]


@pytest.fixture(scope="module")
def isolated(tiny_chat_model, tmp_path_factory):
    """The fixture server's twin in a process of its own (~4 s: the executable cache is warm), for
    the repros: a 500 logs its traceback, and CPython 3.11.7 formats one with ast.parse, whose
    recursion bookkeeping is shared between threads; one logged beside pytest's own ast.parse
    (a failure report) left it broken for the rest of the session (an INTERNALERROR)."""
    folder = tmp_path_factory.mktemp("fuzz-isolated")
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SERVER_DEFAULTS.items()]
    process, base_url = launch_server_process(
        ["--model-path", tiny_chat_model[0], "--served-model-name", "tiny",
         "--file-storage-path", str(folder / "storage"), *flags], folder / "server.log")
    yield base_url, folder / "server.log"
    process.kill()
    process.wait()


@pytest.mark.parametrize("path,content", FOUND,
                         ids=[f"{i}{path}" for i, (path, _) in enumerate(FOUND)])
def test_what_fuzzing_found(isolated, path, content):
    base_url, log = isolated
    logged = log.stat().st_size
    start = time.monotonic()
    response = httpx.post(base_url + path, content=content, timeout=REQUEST_TIMEOUT_S,
                          headers={"content-type": "application/json"})
    elapsed = time.monotonic() - start
    if response.status_code >= 500:  # the server's own frames, for the report
        frames, deadline = [], time.monotonic() + 2
        while not any("Error:" in line for line in frames) and time.monotonic() < deadline:
            time.sleep(0.05)
            with open(log, "rb") as f:
                f.seek(logged)
                frames = [line for line in f.read().decode(errors="replace").splitlines()
                          if "xlaserve/" in line or "Error:" in line]
        pytest.fail(f"{path} -> {response.status_code} {response.text[:300]}\n"
                    + "\n".join(dict.fromkeys(frames[-12:])), pytrace=False)
    check_answer(response, elapsed, orjson.loads(content))


def test_a_query_parameter_error_names_the_parameter(http):
    """Fixed (http/errors.py validation_message): only "body" was dropped from the location, so a
    bad query parameter is named "query"."""
    for path in ("/v1/files", "/v1/batches"):
        start = time.monotonic()
        check_answer(http.get(path, params={"limit": "x"}), time.monotonic() - start)


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
