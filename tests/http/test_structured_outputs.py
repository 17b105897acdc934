"""Structured outputs over HTTP.

SGLang's "Structured Outputs" tutorial cells through the official `openai` SDK on the default model
(SmolLM2-135M-Instruct, greedy). Then every kind of constraint on every route (chat, completions,
/generate, batch lines), streamed, with n > 1 and with logprobs, on the tiny random model of the
other HTTP tests: its output is near-uniform gibberish, so the mask, not the model, is what makes
it valid. Bad constraints (a 400 naming the parameter, `--grammar-backend none`):
test_structured_outputs_bad_input.py.

The JSON cells ask their question as "... Answer in JSON.": with the tutorial's wording the 135M
model, greedy, writes the population as a digit run that never ends (`11111...`), which the
schema allows (so does SGLang's), and the cell would only show `finish_reason: "length"`.
"""
import json
import re
import threading
import time

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.http.conftest import RunningServer
from tests.http.test_batches import chat_line, results, upload, wait
from xlaserve.http.constraints import (CONSTRAINT_REQUEST_FIELDS, CONSTRAINTS, constraint_param,
                                       request_constraint)
from xlaserve.http.serving import asks_for_constraint
from xlaserve.runtime.sampling.params import has_constraint
from xlaserve.runtime.sampling.params import SamplingParams

MODEL = "tiny"
CAPITAL_QUESTION = "What is the capital of France and its population? Answer in JSON."

# The tutorial's EBNF, and a regex for exactly the same language.
EBNF = ('root ::= city | description\n'
        'city ::= "London" | "Paris" | "Berlin" | "Rome"\n'
        'description ::= city " is " status\n'
        'status ::= "the capital of " country\n'
        'country ::= "England" | "France" | "Germany" | "Italy"')
EBNF_AS_REGEX = (r"(London|Paris|Berlin|Rome)"
                 r"|(London|Paris|Berlin|Rome) is the capital of (England|France|Germany|Italy)")
REGEX = "(Paris|London)"

# A schema a near-uniform model finishes in a few tokens (every value from a finite set), with
# enums, a nested object, an array and numbers.
FINITE_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
        "capital": {"type": "boolean"},
        "where": {"type": "object", "properties": {"continent": {"enum": ["Europe", "Asia"]}},
                  "required": ["continent"], "additionalProperties": False},
        "rank": {"type": "integer", "enum": [1, 2, 3]},
        "tags": {"type": "array", "items": {"enum": ["old", "big"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["city", "capital", "where", "rank", "tags"],
    "additionalProperties": False,
}


class CapitalInfo(BaseModel):
    name: str = Field(..., pattern=r"^\w+$", description="Name of the capital city")
    population: int = Field(..., description="Population of the capital city")


def _chat(content: str, **kwargs) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kwargs}


def _assert_openai_error(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    return error


# --- the tutorial's cells on the default model ------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    """The default model behind the whole server, with the launch test's small shapes."""
    running = RunningServer(None, dtype="auto", max_running_requests=4,
                            precompile_token_paddings="8,64", chunked_prefill_size=24,
                            max_prefill_tokens=48, max_total_tokens=1024, context_length=512)
    yield running
    running.close()


@pytest.fixture(scope="module")
def smol_client(smol):
    return smol.openai()


def test_tutorial_cell_json_schema_from_pydantic(smol_client):
    response = smol_client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": CAPITAL_QUESTION}], temperature=0, max_tokens=64,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "foo", "schema": CapitalInfo.model_json_schema()}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    info = CapitalInfo.model_validate_json(choice.message.content)
    assert info.name == "Paris"


def test_tutorial_cell_json_schema_as_a_dict(smol_client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[\\w]+$"},
                                               "population": {"type": "integer"}},
              "required": ["name", "population"]}
    response = smol_client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": CAPITAL_QUESTION}], temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "foo", "schema": schema}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)
    assert json.loads(choice.message.content)["name"] == "Paris"


def test_json_object_gives_a_json_object(smol_client):
    response = smol_client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Describe Paris as a JSON object with its name and "
                                              "country."}],
        temperature=0, max_tokens=64, response_format={"type": "json_object"})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


def test_tutorial_cell_ebnf(smol_client):
    response = smol_client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": "You are a helpful geography bot."},
                  {"role": "user", "content": "Give me the information of the capital of France."}],
        temperature=0, max_tokens=32, extra_body={"ebnf": EBNF})
    choice = response.choices[0]  # greedy, the model starts with "L" (it wants to answer in French)
    assert choice.finish_reason == "stop" and re.fullmatch(EBNF_AS_REGEX, choice.message.content), choice


def test_tutorial_cell_regex(smol_client):
    response = smol_client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=32, extra_body={"regex": REGEX})
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.message.content), choice


def test_tutorial_cell_native_generate_with_json_schema(smol):
    tokenizer = smol.ctx.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": CAPITAL_QUESTION}],
                                         tokenize=False, add_generation_prompt=True)
    schema = CapitalInfo.model_json_schema()
    out = httpx.post(smol.base_url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 64,
                                          "json_schema": json.dumps(schema)}}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert CapitalInfo.model_validate_json(out["text"]).name == "Paris"


# --- every kind, on every route, on the tiny random model -------------------------------------------


def _sampled(temperature: float = 1.0, seed: int = 7) -> dict:
    return {"temperature": temperature, "seed": seed}


@pytest.mark.parametrize("seed", [1, 2])
def test_chat_regex_on_a_random_model(client, seed):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital?"}],
                                              max_tokens=16, n=4, **_sampled(seed=seed),
                                              extra_body={"regex": REGEX})
    for choice in response.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.message.content), choice


def test_chat_ebnf_with_n_every_choice_validates(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital?"}],
                                              max_tokens=48, n=6, **_sampled(), extra_body={"ebnf": EBNF})
    assert len(response.choices) == 6
    for choice in response.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(EBNF_AS_REGEX, choice.message.content), choice
    assert len({c.message.content for c in response.choices}) > 1  # each choice samples its own


def test_chat_json_schema_with_n_every_choice_validates(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city as JSON"}], max_tokens=64, n=4,
        **_sampled(seed=11),
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": FINITE_SCHEMA,
                                                                "strict": True}})
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), FINITE_SCHEMA)


def test_chat_json_schema_extra_body_string(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city as JSON"}], max_tokens=64,
        **_sampled(seed=3), extra_body={"json_schema": json.dumps(FINITE_SCHEMA)})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), FINITE_SCHEMA)


def test_json_object_on_a_random_model_is_json_as_far_as_it_got(client):
    """A near-uniform model rarely closes an open JSON object within a few tokens, but whatever
    stops is a JSON object, and what runs out of tokens is the start of one."""
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=24, n=4,
        **_sampled(seed=5), response_format={"type": "json_object"})
    for choice in response.choices:
        text = choice.message.content
        assert text.lstrip().startswith("{"), text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length"


def test_chat_stream_concatenated_deltas_validate(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital?"}],
                                            max_tokens=48, n=2, stream=True, **_sampled(seed=9),
                                            extra_body={"ebnf": EBNF})
    texts, finishes = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert finishes == ["stop", "stop"]
    assert all(re.fullmatch(EBNF_AS_REGEX, text) for text in texts), texts


def test_chat_logprobs_alongside_a_constraint(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city as JSON"}], max_tokens=64,
        logprobs=True, top_logprobs=2, **_sampled(seed=4),
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": FINITE_SCHEMA}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), FINITE_SCHEMA)
    entries = choice.logprobs.content
    # One entry per generated token (the last, the end of turn the grammar allowed, has no text).
    assert len(entries) == response.usage.completion_tokens
    assert "".join(e.token for e in entries).startswith(choice.message.content)
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)


def test_chat_stream_logprobs_alongside_a_constraint(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Capital?"}], max_tokens=16, stream=True,
        logprobs=True, stream_options={"include_usage": True}, **_sampled(seed=8),
        extra_body={"regex": REGEX})
    text, entries, usage, finish = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            entries += (choice.logprobs.content or []) if choice.logprobs else []
            finish = choice.finish_reason or finish
    assert finish == "stop" and re.fullmatch(REGEX, text)
    assert len(entries) == usage.completion_tokens


def test_completions_take_regex_ebnf_and_json_schema(client):
    for extra, check in [
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"ebnf": EBNF}, lambda t: re.fullmatch(EBNF_AS_REGEX, t)),
        ({"json_schema": json.dumps(FINITE_SCHEMA)},
         lambda t: jsonschema.validate(json.loads(t), FINITE_SCHEMA) is None),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "city", "schema": FINITE_SCHEMA}}},
         lambda t: jsonschema.validate(json.loads(t), FINITE_SCHEMA) is None),
    ]:
        response = client.completions.create(model=MODEL, prompt=["The capital of France is", "A city:"],
                                             max_tokens=64, n=2, logprobs=1, **_sampled(seed=12),
                                             extra_body=extra)
        assert len(response.choices) == 4
        for choice in response.choices:
            assert choice.finish_reason == "stop" and check(choice.text), (extra, choice)
            assert len(choice.logprobs.tokens) >= 1


def test_completions_stream_with_a_constraint(client):
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=48,
                                       stream=True, **_sampled(seed=6), extra_body={"ebnf": EBNF})
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    assert finish == "stop" and re.fullmatch(EBNF_AS_REGEX, text), text


@pytest.mark.parametrize("key,value,check", [
    ("json_schema", json.dumps(FINITE_SCHEMA),
     lambda t: jsonschema.validate(json.loads(t), FINITE_SCHEMA) is None),
    ("regex", REGEX, lambda t: re.fullmatch(REGEX, t)),
    ("ebnf", EBNF, lambda t: re.fullmatch(EBNF_AS_REGEX, t)),
])
def test_native_generate_takes_each_constraint(server, key, value, check):
    body = {"text": ["The capital of France is", "Name a city:"], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "seed": 2, "max_new_tokens": 64, "n": 2, key: value}}
    outs = httpx.post(server.base_url + "/generate", json=body, timeout=120).json()
    assert len(outs) == 4
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop" and check(out["text"]), out
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_native_generate_streams_with_a_constraint(server):
    body = {"text": "The capital of France is", "stream": True,
            "sampling_params": {"temperature": 1.0, "seed": 3, "max_new_tokens": 16, "regex": REGEX}}
    last = None
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    assert last["meta_info"]["finish_reason"]["type"] == "stop" and re.fullmatch(REGEX, last["text"])


def test_different_constraints_in_one_native_call(server):
    body = {"text": ["a", "b"], "sampling_params": [
        {"temperature": 1.0, "seed": 1, "max_new_tokens": 48, "regex": REGEX},
        {"temperature": 1.0, "seed": 1, "max_new_tokens": 48, "ebnf": EBNF}]}
    first, second = httpx.post(server.base_url + "/generate", json=body, timeout=120).json()
    assert re.fullmatch(REGEX, first["text"]) and re.fullmatch(EBNF_AS_REGEX, second["text"])


def test_batch_lines_with_constraints_and_one_invalid(client, tmp_path):
    lines = [chat_line("regex", "Capital?", max_tokens=16, temperature=1.0, seed=1, regex=REGEX),
             chat_line("schema", "City?", max_tokens=64, temperature=1.0, seed=1,
                       response_format={"type": "json_schema",
                                        "json_schema": {"name": "c", "schema": FINITE_SCHEMA}}),
             chat_line("bad", "Capital?", max_tokens=16, regex="[a-")]
    batch = client.batches.create(input_file_id=upload(client, tmp_path, lines).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait(client, batch)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    done = results(client, batch.output_file_id)
    regex_choice = done["regex"]["response"]["body"]["choices"][0]
    assert regex_choice["finish_reason"] == "stop" and re.fullmatch(REGEX, regex_choice["message"]["content"])
    schema_choice = done["schema"]["response"]["body"]["choices"][0]
    jsonschema.validate(json.loads(schema_choice["message"]["content"]), FINITE_SCHEMA)
    failed = results(client, batch.error_file_id)["bad"]["response"]
    assert failed["status_code"] == 400 and failed["body"]["error"]["param"] == "regex"


def test_response_format_text_and_sglangs_schema_shorthand(client):
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0, logit_bias={"2": -100},
                                           response_format={"type": "text"})
    assert plain.usage.completion_tokens == 3
    short = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "City?"}], max_tokens=64, **_sampled(seed=2),
        response_format={"type": "json_schema", "schema": FINITE_SCHEMA})
    jsonschema.validate(json.loads(short.choices[0].message.content), FINITE_SCHEMA)


def test_a_slow_grammar_build_does_not_stall_other_requests(server, client, monkeypatch):
    """The build runs in a worker thread: while one is held up, other requests are served."""
    core = server.ctx.engine.core
    building, release = threading.Event(), threading.Event()
    compile_grammar = core.compile_grammar

    def slow_compile(params):
        if params.regex == "(slow|grammar)" and not building.is_set():
            building.set()
            assert release.wait(30)
        return compile_grammar(params)

    monkeypatch.setattr(core, "compile_grammar", slow_compile)
    slow = {}
    thread = threading.Thread(target=lambda: slow.update(reply=client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        extra_body={"regex": "(slow|grammar)"})))
    thread.start()
    try:
        assert building.wait(30)
        start = time.monotonic()
        other = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8, temperature=0, extra_body={"regex": REGEX})
        assert re.fullmatch(REGEX, other.choices[0].message.content)
        assert time.monotonic() - start < 10 and "reply" not in slow
    finally:
        release.set()
        thread.join(30)
    assert re.fullmatch("(slow|grammar)", slow["reply"].choices[0].message.content)


# --- requests without a constraint skip constraints.py ----------------------------------------------


class _Fields:
    """A request whose fields are all None but `given`; records each field read."""

    def __init__(self, **given):
        self.__dict__["given"], self.__dict__["read"] = given, set()

    def __getattr__(self, name):
        self.read.add(name)
        return self.given.get(name)


def test_the_skip_test_reads_every_field_constraints_py_reads():
    """The routes call constraints.py only when serving.asks_for_constraint says the request
    sets one of CONSTRAINT_REQUEST_FIELDS: a field read there but missing from the list would be
    a constraint silently dropped."""
    request = _Fields()
    assert request_constraint(request) is None and constraint_param(request) is None
    assert request.read == set(CONSTRAINT_REQUEST_FIELDS)
    assert not asks_for_constraint(_Fields())
    for name in CONSTRAINT_REQUEST_FIELDS:
        assert asks_for_constraint(_Fields(**{name: "x"})), name
    assert not has_constraint(SamplingParams())
    for name in CONSTRAINTS:
        assert has_constraint(SamplingParams(**{name: "x"})), name
