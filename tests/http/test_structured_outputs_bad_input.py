"""Structured outputs over HTTP, bad input: each bad constraint is a 400 in OpenAI's shape naming
its parameter, on chat, completions and /generate; the server still serves after all of them; and
`--grammar-backend none` refuses every constraint with a 400. The constraints that work:
test_structured_outputs.py."""
import json
import re

import httpx
import pytest

from tests.http.conftest import RunningServer
from tests.http.test_structured_outputs import (EBNF, FINITE_SCHEMA, MODEL, REGEX,
                                                _assert_openai_error, _chat)


# --- bad input: a 400 naming the parameter, each its own test -------------------------------------


BAD_CHAT = [
    ("invalid_regex", {"regex": "[a-"}, "regex"),
    ("undefined_ebnf_rule", {"ebnf": "root ::= foo"}, "ebnf"),
    ("ebnf_syntax", {"ebnf": "root ::= \"unclosed"}, "ebnf"),
    ("json_schema_not_json", {"json_schema": "{bad"}, "json_schema"),
    ("json_schema_unknown_type", {"json_schema": json.dumps({"type": "strnig"})}, "json_schema"),
    ("json_schema_unknown_format", {"json_schema": json.dumps({"type": "string", "format": "weird"})},
     "json_schema"),
    ("json_schema_unsupported_keyword", {"json_schema": json.dumps({"not": {"type": "string"}})},
     "json_schema"),
    ("response_format_bad_schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format"),
    ("response_format_schema_pattern",
     {"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[a-"}}}},
     "response_format"),
    ("two_constraints", {"regex": "a", "ebnf": "root ::= \"a\""}, "ebnf"),
    ("json_schema_and_regex", {"regex": "a", "json_schema": "{}"}, "regex"),
    ("constraint_and_response_format", {"regex": "a", "response_format": {"type": "json_object"}},
     "response_format"),
    ("response_format_json_schema_without_schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("response_format_json_schema_without_object", {"response_format": {"type": "json_schema"}},
     "response_format"),
    ("response_format_schema_not_an_object",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format"),
    ("response_format_unknown_type", {"response_format": {"type": "yaml"}}, "response_format"),
    ("response_format_without_type", {"response_format": {}}, "response_format"),
    ("response_format_unknown_field", {"response_format": {"type": "json_object", "fmt": 1}},
     "response_format"),
    ("json_schema_not_a_string", {"json_schema": {"type": "object"}}, "json_schema"),
]


@pytest.mark.parametrize("change,param", [c[1:] for c in BAD_CHAT], ids=[c[0] for c in BAD_CHAT])
def test_bad_constraints_on_chat_are_a_400_naming_the_parameter(server, change, param):
    response = httpx.post(server.base_url + "/v1/chat/completions", json=_chat("hi", max_tokens=4, **change))
    _assert_openai_error(response, param)


def test_two_constraints_keep_sglangs_message_and_name_both(server):
    response = httpx.post(server.base_url + "/v1/chat/completions",
                          json=_chat("hi", max_tokens=4, regex="a", ebnf='root ::= "a"'))
    assert _assert_openai_error(response, "ebnf")["message"] == \
        "Only one of regex, json_schema, or ebnf can be set: got regex and ebnf"


def test_an_unsupported_schema_keyword_is_named(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", json=_chat(
        "hi", max_tokens=4, json_schema=json.dumps({"type": "array", "uniqueItems": True})))
    assert "uniqueItems" in _assert_openai_error(response, "json_schema")["message"]


def test_an_unknown_format_is_named(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", json=_chat(
        "hi", max_tokens=4, json_schema=json.dumps({"type": "string", "format": "weird"})))
    assert "weird" in _assert_openai_error(response, "json_schema")["message"]


STRUCTURES = [{"begin": "<function=get_weather>", "end": "</function>",
               "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}]


def test_a_structural_tag_response_format_is_served(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json=_chat(
        "hi", max_tokens=8, response_format={"type": "structural_tag", "structures": STRUCTURES,
                                             "triggers": ["<function="]}))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("response_format, says", [
    ({"type": "structural_tag", "structures": [], "triggers": []}, "needs a list of structures"),
    ({"type": "structural_tag", "structures": STRUCTURES, "triggers": ["<tool>"]},
     "starts with none of the triggers"),
    ({"type": "structural_tag", "structures": [{**STRUCTURES[0], "schema": {"type": "strnig"}}],
      "triggers": ["<function="]}, "strnig"),
])
def test_a_bad_structural_tag_is_a_400(server, response_format, says):
    response = httpx.post(server.base_url + "/v1/chat/completions", json=_chat(
        "hi", max_tokens=4, response_format=response_format))
    assert says in _assert_openai_error(response, "response_format")["message"]


@pytest.mark.parametrize("extra,param", [({"regex": "[a-"}, "regex"), ({"ebnf": "root ::= foo"}, "ebnf"),
                                         ({"json_schema": "{bad"}, "json_schema"),
                                         ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf")],
                         ids=["regex", "ebnf", "json_schema", "two"])
def test_bad_constraints_on_completions_are_a_400(server, extra, param):
    response = httpx.post(server.base_url + "/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra})
    _assert_openai_error(response, param)


@pytest.mark.parametrize("params,param", [
    ({"regex": "[a-"}, "sampling_params.regex"),
    ({"ebnf": "root ::= foo"}, "sampling_params.ebnf"),
    ({"json_schema": "{bad"}, "sampling_params.json_schema"),
    ({"json_schema": {"type": "object"}}, "sampling_params.json_schema"),
    ({"regex": "a", "json_schema": "{}"}, "sampling_params.regex"),
], ids=["regex", "ebnf", "json_schema", "json_schema_not_a_string", "two"])
def test_bad_constraints_on_native_generate_are_a_400(server, params, param):
    response = httpx.post(server.base_url + "/generate",
                          json={"text": "hi", "sampling_params": {"max_new_tokens": 4, **params}})
    _assert_openai_error(response, param)


def test_the_sdk_raises_bad_request_for_a_bad_schema(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="strnig"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}})


SELF_ONLY = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}  # issue 48


@pytest.mark.parametrize("schema", [
    SELF_ONLY,  # was a 200 whose content was not JSON at all
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
     "$defs": {"a": {"$ref": "#/$defs/a"}}},  # the same, where the answer would reach it
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 3}},
     "required": ["n"]},
])
def test_a_schema_no_value_satisfies_is_a_400_naming_response_format(client, schema):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert refused.value.body["param"] == "response_format"
    assert "satisf" in refused.value.body["message"].lower()


# A grammar with a branch no text completes, which only generating can reach: "x" then `a`, a
# rule with no end (its first mask allows "x" and "y"). The bias makes the model take "x".
DEAD_END_EBNF = 'root ::= "x" a | "y"\na ::= a'


def _dead_end_body(server, **kwargs) -> dict:
    x = server.ctx.tokenizer.encode("x", add_special_tokens=False)
    return _chat("hi", max_tokens=8, ebnf=DEAD_END_EBNF, logit_bias={str(x[0]): 100}, **kwargs)


def test_an_answer_its_grammar_cannot_complete_is_a_400_not_a_stop(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", json=_dead_end_body(server))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "constraint_unsatisfiable"
    assert error["message"].startswith("the output cannot be completed under its constraint")


def test_a_streamed_answer_its_grammar_cannot_complete_ends_with_an_error_event(server):
    with httpx.stream("POST", server.base_url + "/v1/chat/completions",
                      json=_dead_end_body(server, stream=True), timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert [e["code"] for e in errors] == ["constraint_unsatisfiable"]
    finishes = [c["finish_reason"] for e in events[:-1] if "error" not in json.loads(e)
                for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert "stop" not in finishes and events[-1] == "[DONE]"


def test_the_server_still_serves_after_the_bad_constraints(server, client):
    for change, _ in [c[1:] for c in BAD_CHAT]:  # all of them again, back to back
        assert httpx.post(server.base_url + "/v1/chat/completions",
                          json=_chat("hi", max_tokens=4, **change)).status_code == 400
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0, logit_bias={"2": -100})
    assert plain.usage.completion_tokens == 3
    constrained = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=16, temperature=0, extra_body={"regex": REGEX})
    assert constrained.choices[0].finish_reason == "stop"
    assert re.fullmatch(REGEX, constrained.choices[0].message.content)
    assert httpx.get(server.base_url + "/health").status_code == 200


# --- --grammar-backend none ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_grammar(tiny_chat_model):
    """The tiny model with constrained decoding off; nothing here generates, so nothing compiles."""
    running = RunningServer(tiny_chat_model[0], served_model_name=MODEL, grammar_backend="none",
                            disable_precompile=True, skip_server_warmup=True)
    yield running
    running.close()


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", _chat("hi", max_tokens=4, regex=REGEX), "regex"),
    ("/v1/chat/completions", _chat("hi", max_tokens=4, response_format={"type": "json_object"}),
     "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                         "json_schema": json.dumps(FINITE_SCHEMA)}, "json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "ebnf": EBNF}},
     "sampling_params.ebnf"),
], ids=["chat_regex", "chat_json_object", "completions_json_schema", "generate_ebnf"])
def test_grammar_backend_none_refuses_constraints_with_a_400(no_grammar, route, body, param):
    error = _assert_openai_error(httpx.post(no_grammar.base_url + route, json=body), param)
    assert "--grammar-backend none" in error["message"]
