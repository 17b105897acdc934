"""What fuzzing every route (test_fuzz.py) found, each kept as a minimal repro with where it was
fixed: each must now be answered below 500, in OpenAI's error shape naming a field it sent."""
from __future__ import annotations

import json
import time

import httpx
import orjson
import pytest

from tests.http.conftest import SERVER_DEFAULTS, launch_server_process
from tests.http.fuzz_support import REQUEST_TIMEOUT_S, check_answer, http  # noqa: F401



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
    # Fixed (runtime/sampling/grammar.py): llguidance refuses a boolean schema with options, and the
    # Infinity / NaN that Python's json reads: ValueError, a 500.
    ("/generate", _generate_with({"json_schema": "false"})),
    ("/v1/chat/completions", _chat_with('"json_schema": "true"')),
    ("/generate", _generate_with({"json_schema": '{"type": "string", "minLength": 1e400}'})),
    ("/generate", _generate_with({"json_schema": '{"type": "integer", "maximum": NaN}'})),
    # Fixed (runtime/sampling/grammar.py closed_objects, its json.loads): a schema nested 500 deep is a
    # RecursionError, a 500.
    ("/v1/chat/completions", _chat_with('"response_format": {"type": "json_schema", "json_schema": '
                                        '{"name": "x", "schema": ' + _nested(500) + "}}")),
    ("/generate", _generate_with({"json_schema": _nested(500)})),
    ("/generate", _generate_with({"json_schema": _nested(1000)})),
    ("/generate", _generate_with({"structural_tag": json.dumps({"structures": [
        {"begin": "<a>", "schema": json.loads(_nested(500)), "end": "</a>"}], "triggers": ["<a"]})})),
    # Fixed (http/constraints.py response_format_constraint, http/parsing/tools.py check_tools: json.dumps):
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
