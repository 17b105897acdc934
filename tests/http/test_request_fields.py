"""Request fields of OpenAI, vLLM and SGLang clients (issue 34, item 1): OpenAI's chat fields
accepted (no-ops) or refused by name, vLLM's structured-output fields as constraints, SGLang's
/generate sampling keys, and unknown fields ignored (logged once, named in X-Ignored-Fields)
unless --strict-request-fields."""
from __future__ import annotations

import dataclasses
import json
import logging
import re

import httpx
import pytest

from tests.http.conftest import AppServer
from xlaserve.http.constraints import choice_regex
from xlaserve.http.request_fields import (IGNORED_FIELDS_HEADER, MAX_HEADER_NAMES,
                                          MAX_LOGGED_NAMES, RequestFields, header_value)

EOS = 2  # <|im_end|>
NO_EOS = {"logit_bias": {str(EOS): -100}}
USER = [{"role": "user", "content": "Say something."}]
FIELDS_LOGGER = "xlaserve.http.request_fields"


def _chat_raw(client, **kwargs):
    """(the parsed chat completion, the HTTP response's headers) through the OpenAI SDK."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=kwargs.pop("messages", USER), **kwargs)
    return raw.parse(), raw.headers


def _text(client, **kwargs) -> str:
    return client.chat.completions.create(model="tiny", messages=USER, **kwargs).choices[0].message.content


def _warnings_naming(caplog, name: str) -> int:
    return sum(name in r.getMessage() for r in caplog.records
               if r.name == FIELDS_LOGGER and r.levelno == logging.WARNING)


# --- unknown fields: the tolerant default ---------------------------------------------------------

def test_unknown_fields_are_served_named_in_a_header_and_logged_once(client, caplog):
    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        for _ in range(2):
            reply, headers = _chat_raw(client, max_tokens=3, temperature=0,
                                       extra_body={"x_tolerant_knob": 1, "x_tolerant_other": {"a": 1}})
            assert reply.choices[0].finish_reason == "length"
            assert headers[IGNORED_FIELDS_HEADER] == "x_tolerant_knob, x_tolerant_other"
    assert _warnings_naming(caplog, "x_tolerant_knob") == 1
    assert _warnings_naming(caplog, "x_tolerant_other") == 1


def test_a_request_without_unknown_fields_has_no_header(client):
    _, headers = _chat_raw(client, max_tokens=2)
    assert IGNORED_FIELDS_HEADER not in headers


def test_unknown_stream_options_keys_are_ignored_and_the_stream_still_counts_usage(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "x_future_option": True}}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers[IGNORED_FIELDS_HEADER] == "stream_options.x_future_option"
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 3


def test_completions_and_generate_ignore_unknown_fields_too(server):
    response = httpx.post(server.base_url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "x_completion_knob": 1})
    assert response.status_code == 200 and response.headers[IGNORED_FIELDS_HEADER] == "x_completion_knob"
    response = httpx.post(server.base_url + "/generate", timeout=60, json={
        "text": "hi", "sampling_params": {"max_new_tokens": 2}, "x_generate_knob": None})
    assert response.status_code == 200 and response.headers[IGNORED_FIELDS_HEADER] == "x_generate_knob"


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})])
@pytest.mark.parametrize("field,value", [
    ("lora_id", "7"),
    ("custom_logit_processor", "{}"), ("session_params", {"id": "s"}),
    ("image_data", "https://example.com/cat.png")])
def test_fields_that_would_change_what_answers_are_a_400_naming_them(server, route, body, field,
                                                                     value):
    """Dropped as unknown, these would be answered by the base model on the text alone, with a
    200; refused by name instead, and so under --strict-request-fields too."""
    response = httpx.post(server.base_url + route, json={**body, field: value}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported_parameter")
    assert field in error["message"]
    if (route, field) == ("/generate", "image_data"):
        return  # a field /generate knows: its route refuses it on a text model (above)
    fields = RequestFields(strict=True)
    with pytest.raises(Exception) as refused:
        fields.drop_unknown({**body, field: value}, _model_of(route))
    assert getattr(refused.value, "param", None) == field


def _model_of(route: str):
    from xlaserve.http.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

    return {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
            "/generate": GenerateRequest}[route]


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})])
@pytest.mark.parametrize("value", ["/adapters/sql-lora", ["sql-lora"]])
def test_an_adapter_on_a_server_without_adapters_is_a_400_naming_it(server, route, body, value):
    """Never the base model's answer (tests/http/test_lora_server.py: a server with adapters)."""
    response = httpx.post(server.base_url + route, json={**body, "lora_path": value}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "lora_path"


def test_an_adapter_field_that_asks_for_none_is_the_base_model(server):
    for value in (None, [None]):
        response = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 2, "lora_path": value})
        assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers


def test_the_header_escapes_names_and_lists_at_most_its_limit():
    assert header_value(["a,b", "é\n"]) == "a\\x2cb, \\xe9\\n"
    listed = header_value([f"f{i}" for i in range(MAX_HEADER_NAMES + 5)]).split(", ")
    assert len(listed) == MAX_HEADER_NAMES + 1 and listed[-1] == "..."


def test_logging_remembers_a_bounded_number_of_names(caplog):
    fields = RequestFields()

    class Body:  # any pydantic-like model: only model_fields is read
        model_fields = {"known": None}

    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        for i in range(MAX_LOGGED_NAMES + 10):
            body, ignored = fields.drop_unknown({"known": 1, f"n{i}": 2}, Body)
            assert body == {"known": 1} and ignored == [f"n{i}"]
    lines = [r.getMessage() for r in caplog.records if r.name == FIELDS_LOGGER]
    assert len(lines) == MAX_LOGGED_NAMES + 1 and "further new ones are not" in lines[-1]


# --- --strict-request-fields ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def strict_server(server):
    """The session's engine behind an app with --strict-request-fields' policy."""
    from xlaserve.http.app import create_app

    ctx = dataclasses.replace(server.ctx, request_fields=RequestFields(strict=True))
    app = AppServer(create_app(ctx), ctx)
    yield app
    app.close()


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": USER, "unknown_knob": 1}, "unknown_knob"),
    ("/v1/chat/completions", {"messages": USER, "stream": True,
                              "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "unknown_knob": 1}, "unknown_knob"),
    ("/generate", {"text": "hi", "unknown_knob": 1}, "unknown_knob")])
def test_strict_request_fields_refuses_unknown_fields_by_name(strict_server, route, body, param):
    response = httpx.post(strict_server.base_url + route, json={"model": "tiny", "max_tokens": 2, **body}
                          if route != "/generate" else body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "unknown or unsupported parameter" in error["message"]


def test_strict_request_fields_still_takes_every_known_field(strict_server):
    reply, headers = _chat_raw(strict_server.openai(), max_tokens=2, store=False, user="u",
                               extra_body={"guided_choice": ["yes", "no"]})
    assert reply.choices[0].message.content in ("yes", "no")
    assert IGNORED_FIELDS_HEADER not in headers


def test_the_flag_parses_and_is_documented():
    import argparse

    from xlaserve.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--strict-request-fields"])).strict_request_fields
    assert not ServerArgs.from_cli_args(parser.parse_args([])).strict_request_fields
    assert "--strict-request-fields" in parser.format_help()
    help_text = next(f for f in dataclasses.fields(ServerArgs) if f.name == "strict_request_fields")
    assert "X-Ignored-Fields" in help_text.metadata["help"]


# --- OpenAI's chat fields ------------------------------------------------------------------------

def test_openais_no_op_fields_are_accepted_and_change_nothing(client):
    plain = _text(client, max_tokens=8, temperature=0, extra_body=NO_EOS)
    reply, headers = _chat_raw(
        client, max_tokens=8, temperature=0, store=True, metadata={"k": "v"}, service_tier="auto",
        user="u1", safety_identifier="s1", prompt_cache_key="key", verbosity="low",
        prediction={"type": "content", "content": "predicted text"}, modalities=["text"],
        parallel_tool_calls=True, reasoning_effort="xhigh", prompt_cache_retention="24h",
        extra_body=NO_EOS)
    assert reply.choices[0].message.content == plain
    assert IGNORED_FIELDS_HEADER not in headers


# Every field of the SDK's chat and completion requests, null: OpenAI takes null as "not given".
NULL_CHAT = ["audio", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
             "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort",
             "response_format", "safety_identifier", "seed", "service_tier", "stop", "store",
             "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
             "top_p", "user", "verbosity", "web_search_options", "moderation",
             "prompt_cache_options", "function_call", "functions"]
NULL_COMPLETION = ["best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
                   "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
                   "temperature", "top_p", "user"]


def test_every_openai_field_may_be_null(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": USER, "max_completion_tokens": 4, **dict.fromkeys(NULL_CHAT)})
    assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers, response.text
    response = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hi", **dict.fromkeys(NULL_COMPLETION)})
    assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers, response.text
    assert response.json()["usage"]["completion_tokens"] <= 16  # max_tokens null: the default 16


def test_include_obfuscation_is_accepted_in_stream_options(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("field,value", [
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}), ("moderation", {"model": "omni-moderation-latest"}),
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto")])
def test_fields_asking_for_output_this_server_cannot_give_are_a_400_naming_them(server, field, value):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": USER, "max_tokens": 2, field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


# --- vLLM's structured outputs -------------------------------------------------------------------

REGEX = r"(cat|dog)-[0-9]{2}"


@pytest.mark.parametrize("extra", [{"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}])
def test_a_vllm_regex_constrains_the_output(client, extra):
    text = _text(client, max_tokens=16, temperature=1.0, seed=3, extra_body=extra)
    assert re.fullmatch(REGEX, text), text


CHOICES = ["a+b", "(x)", "1.5", "yes|no"]  # regex metacharacters: each taken literally


@pytest.mark.parametrize("extra", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}])
def test_a_vllm_choice_is_one_of_the_choices(client, extra):
    outputs = {_text(client, max_tokens=8, temperature=1.0, seed=s, extra_body=extra) for s in range(4)}
    assert outputs <= set(CHOICES), outputs


def test_choice_regex_escapes_rust_metacharacters():
    assert choice_regex(["a.b", "c|d"], "guided_choice") == r"(a\.b|c\|d)"


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("extra", [
    {"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)}, {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"json_object": True}, "guided_decoding_backend": "xgrammar"}])
def test_a_vllm_json_schema_gives_json(client, extra):
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0,
                                           extra_body=extra).choices[0]
    if reply.finish_reason == "stop":
        value = json.loads(reply.message.content)
        assert isinstance(value, dict) and ("json_object" in str(extra) or isinstance(value["n"], int))
    else:  # cut at max_tokens: still a prefix of JSON
        assert reply.message.content.startswith("{")


@pytest.mark.parametrize("grammar", ['root ::= "yes" | "no"', 'start: "yes" | "no"'])
def test_guided_grammar_takes_gbnf_and_lark(client, grammar):
    for kind in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        assert _text(client, max_tokens=4, temperature=1.0, seed=1, extra_body=kind) in ("yes", "no")


@pytest.mark.parametrize("extra,param,other", [
    ({"guided_regex": "a", "regex": "b"}, "guided_regex", "regex"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "structured_outputs.regex", "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json", "response_format")])
def test_two_constraints_are_a_400_naming_both(server, extra, param, other):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": USER, "max_tokens": 2, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and other in error["message"] and param in error["message"]


@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "[a-"}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]*"}, "guided_whitespace_pattern")])
def test_bad_vllm_constraints_are_a_400_naming_the_field(server, extra, param):
    for route, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "hi"})):
        response = httpx.post(server.base_url + route, timeout=60,
                              json={"model": "tiny", "max_tokens": 2, **body, **extra})
        assert response.status_code == 400, (route, response.text)
        assert response.json()["error"]["param"] == param, route


def test_completions_take_vllm_constraints(client):
    text = client.completions.create(model="tiny", prompt="Pet:", max_tokens=8, temperature=1.0,
                                     seed=2, extra_body={"guided_choice": ["cat", "dog"]}).choices[0].text
    assert text in ("cat", "dog")


# --- SGLang's /generate sampling keys ------------------------------------------------------------

def _generate(server, **params):
    response = httpx.post(server.base_url + "/generate", timeout=60, json={
        "text": "Once", "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, **params}})
    return response


def test_sampling_seed_is_seed(server):
    by_seed = _generate(server, seed=11).json()["text"]
    assert _generate(server, sampling_seed=11).json()["text"] == by_seed
    assert _generate(server, sampling_seed=11, seed=11).json()["text"] == by_seed
    response = _generate(server, sampling_seed=11, seed=12)
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling_params.sampling_seed"


def test_spaces_between_special_tokens_and_custom_params_change_nothing(server):
    plain = _generate(server, seed=5, skip_special_tokens=False).json()["text"]
    for extra in ({"spaces_between_special_tokens": False}, {"spaces_between_special_tokens": True},
                  {"custom_params": {"anything": 1}}):
        response = _generate(server, seed=5, skip_special_tokens=False, **extra)
        assert response.status_code == 200 and response.json()["text"] == plain, extra


def test_stop_regex_is_a_400_naming_it(server):
    response = _generate(server, stop_regex=r"\d")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "sampling_params.stop_regex"
    assert _generate(server, stop_regex=None).status_code == 200
