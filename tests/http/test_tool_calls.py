"""Tool calling through the server and the `openai` SDK: forced tool_choice (required, a named
function) on the default model, 30 samples at temperature 1.0 whose arguments validate, streamed
and not; a tiny Qwen2 with Qwen2.5's real tools template round-tripping tools -> call -> tool
result -> answer; the --tool-call-parser path on real server output; the bad inputs."""
import collections
import json
import os
import subprocess
import sys

import jsonschema
import pytest

from tests.http.conftest import RunningServer

TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "qwen2.5-instruct.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32},
                                                    "hour24": {"type": "boolean"}},
                   "required": ["timezone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris, and what time is it there?"}]
SAMPLES = 30


@pytest.fixture(scope="module")
def smol():
    running = RunningServer(None, dtype="auto", max_running_requests=32,
                            precompile_token_paddings="32,256", precompile_bs_paddings="32",
                            chunked_prefill_size=256, max_prefill_tokens=256,
                            max_total_tokens=16384, context_length=1024)
    yield running
    running.close()


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed_calls(stream) -> tuple[dict, dict]:
    """choice index -> {call index: [name, arguments]}, and choice index -> finish reason."""
    calls, finish = collections.defaultdict(dict), {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                entry = calls[choice.index].setdefault(delta.index, [None, ""])
                if delta.function.name:
                    assert entry[0] is None and delta.id.startswith("call_") and delta.type == "function"
                    entry[0] = delta.function.name
                entry[1] += delta.function.arguments or ""
            assert not (choice.delta.content or "").strip().startswith("{")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_that_call_with_valid_arguments(smol, stream):
    client = smol.openai()
    kwargs = dict(model="default", messages=QUESTION, tools=[WEATHER, TIME], n=SAMPLES,
                  temperature=1.0, seed=1, max_tokens=96,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        assert len(reply.choices) == SAMPLES
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            check_call(call.function.name, call.function.arguments)
        return
    calls, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert set(finish.values()) == {"tool_calls"} and len(finish) == SAMPLES
    for choice_calls in calls.values():
        assert list(choice_calls) == [0] and choice_calls[0][0] == "get_weather"
        check_call(*choice_calls[0])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_gives_calls_of_the_given_tools(smol, stream):
    # The array of calls has no bound, and this 135M model sometimes repeats a call until
    # max_tokens (3 of these 30): those end with "length" and keep their whole calls only.
    client = smol.openai()
    kwargs = dict(model="default", messages=QUESTION, tools=[WEATHER, TIME], n=SAMPLES,
                  temperature=1.0, seed=2, max_tokens=160, tool_choice="required")
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        reasons = collections.Counter(c.finish_reason for c in reply.choices)
        assert set(reasons) <= {"tool_calls", "length"} and reasons["tool_calls"] >= SAMPLES * 0.8
        for choice in reply.choices:
            assert choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                check_call(call.function.name, call.function.arguments)
        return
    calls, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert len(finish) == SAMPLES and set(finish.values()) <= {"tool_calls", "length"}
    assert len(calls) == SAMPLES
    for choice_calls in calls.values():
        assert choice_calls
        for name, arguments in choice_calls.values():
            check_call(name, arguments)


def test_parallel_tool_calls_false_makes_at_most_one_call(smol):
    reply = smol.openai().chat.completions.create(
        model="default", messages=QUESTION, tools=[WEATHER, TIME], n=8, temperature=1.0, seed=3,
        max_tokens=160, tool_choice="required", parallel_tool_calls=False)
    assert all(len(c.message.tool_calls) == 1 for c in reply.choices)


def test_a_forced_call_cut_by_max_tokens_is_no_call(smol):
    reply = smol.openai().chat.completions.create(
        model="default", messages=QUESTION, tools=[WEATHER], max_tokens=4, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("{")


# --- the Qwen2.5 template on a tiny model, with the qwen25 parser --------------------------------


@pytest.fixture(scope="module")
def qwen(tiny_chat_model):
    running = RunningServer(tiny_chat_model[0], served_model_name="tiny", chat_template=TEMPLATE,
                            tool_call_parser="qwen25")
    yield running
    running.close()


def test_tools_call_result_answer_round_trip_through_the_qwen25_template(qwen):
    client = qwen.openai()
    first = client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=[WEATHER], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    check_call(call.function.name, call.function.arguments)
    messages = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                            temperature=0, max_tokens=8)
    assert second.choices[0].message.content  # the tiny model's gibberish answer
    # The call and its result went back into the prompt as the template writes them.
    prompt = qwen.ctx.tokenizer.apply_chat_template(
        [QUESTION[0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "content": "18 C, sunny"}],
        tools=[WEATHER], chat_template=open(TEMPLATE).read(), tokenize=False,
        add_generation_prompt=True)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert second.usage.prompt_tokens == len(qwen.ctx.tokenizer.encode(prompt))


CALL_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_the_qwen25_parser_turns_tool_call_markup_into_tool_calls(qwen, stream):
    # A regex makes the tiny model write exactly what a Qwen model writes when it calls a tool.
    client = qwen.openai()
    kwargs = dict(model="tiny", messages=QUESTION, tools=[WEATHER], temperature=0,
                  max_tokens=64, extra_body={"regex": CALL_TEXT.replace("{", "\\{")
                                             .replace("}", "\\}").replace(".", "\\.")})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content.strip() == "Let me check."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        return
    content = ""
    calls, finish = collections.defaultdict(dict), None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                entry = calls[delta.index].setdefault("call", [None, ""])
                entry[0] = entry[0] or delta.function.name
                entry[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert content.strip() == "Let me check." and finish == "tool_calls"
    name, arguments = calls[0]["call"]
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris", "unit": "celsius"}


def test_tool_choice_none_leaves_markup_as_text(qwen):
    choice = qwen.openai().chat.completions.create(
        model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice="none", temperature=0,
        max_tokens=64, extra_body={"regex": "<tool_call>x</tool_call>"}).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == "<tool_call>x</tool_call>"
    assert choice.finish_reason == "stop"


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]},
     "tools", "strnig"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools", "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "needs a name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "type 'function'"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
])
def test_bad_tool_requests_are_400s_naming_the_parameter(qwen, body, param, says):
    import httpx

    response = httpx.post(qwen.base_url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": QUESTION, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_an_unknown_tool_call_parser_is_a_start_up_error_listing_the_names():
    result = subprocess.run([sys.executable, "-m", "xlaserve.launch_server", "--tool-call-parser",
                             "nope"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "qwen25" in result.stderr and "pythonic" in result.stderr


def test_the_launch_flag_offers_every_parser():
    from xlaserve.http.parsing.tool_parsers import TOOL_CALL_PARSERS
    from xlaserve.server_args import ServerArgs

    field = next(f for f in ServerArgs.__dataclass_fields__.values() if f.name == "tool_call_parser")
    assert sorted(field.metadata["choices"]) == sorted(TOOL_CALL_PARSERS)


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


def test_strict_tools_under_auto_are_held_to_their_schema(qwen):
    from xlaserve.http.parsing.tools import check_tools, strict_tool_tag

    tag = strict_tool_tag("qwen25", check_tools([STRICT_WEATHER, TIME]))
    backend = qwen.ctx.engine.core.grammar_backend
    tokenizer = qwen.ctx.tokenizer

    def accepts(text):
        grammar = backend.new_grammar("structural_tag", tag)
        return all(grammar.consume(t) for t in tokenizer.encode(text, add_special_tokens=False))

    good = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>')
    assert accepts(good)
    assert not accepts(good.replace('"celsius"', '"kelvin"'))  # the strict tool's enum
    assert not accepts('<tool_call>\n{"name": "get_wether", "arguments": {}}')  # unknown name
    assert accepts('<tool_call>\n{"name": "get_time", "arguments": {"anything": 1}}\n</tool_call>')
    # And the server serves such a request (the tiny model answers in free text).
    reply = qwen.openai().chat.completions.create(model="tiny", messages=QUESTION, max_tokens=16,
                                                  tools=[STRICT_WEATHER, TIME], temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_strict_tools_under_auto_with_a_parser_that_cannot_hold_them_are_a_400():
    from xlaserve.http.errors import APIError
    from xlaserve.http.parsing.tools import check_tools, strict_tool_tag

    with pytest.raises(APIError) as error:
        strict_tool_tag("llama3", check_tools([STRICT_WEATHER]))
    assert error.value.status == 400 and error.value.param == "tools"
    assert strict_tool_tag("llama3", check_tools([WEATHER])) is None  # nothing strict


def test_a_tool_calling_batch_line_answers_what_the_live_endpoint_does(qwen, tmp_path):
    import httpx

    from tests.http.test_batches import results, upload, wait

    client = qwen.openai()
    body = dict(model="tiny", messages=QUESTION, tools=[WEATHER, TIME], temperature=0,
                max_tokens=64, tool_choice="required")
    uploaded = upload(client, tmp_path, [{"custom_id": "tools", "method": "POST",
                                          "url": "/v1/chat/completions", "body": body}])
    batch = wait(client, client.batches.create(input_file_id=uploaded.id,
                                               endpoint="/v1/chat/completions",
                                               completion_window="24h"))
    got = results(client, batch.output_file_id)["tools"]["response"]["body"]
    live = httpx.post(qwen.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    for reply in (got, live):
        reply.pop("id"), reply.pop("created")
        reply["usage"].pop("prompt_tokens_details")  # the live one hits the batch's cached prompt
        for call in reply["choices"][0]["message"]["tool_calls"]:
            assert call.pop("id").startswith("call_")  # fresh per response
    assert got == live


@pytest.fixture(scope="module")
def thinking_qwen(tiny_chat_model):
    running = RunningServer(tiny_chat_model[0], served_model_name="tiny", chat_template=TEMPLATE,
                            tool_call_parser="qwen25", reasoning_parser="qwen3")
    yield running
    running.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_that_thinks_then_calls_a_tool_gives_both(thinking_qwen, stream):
    output = "<think>\nThe user wants the weather.\n</think>\n\n" + CALL_TEXT
    regex = "".join("\\" + c if c in "{}.()[]?*+|^$\\" else c for c in output)
    kwargs = dict(model="tiny", messages=QUESTION, tools=[WEATHER], temperature=0, max_tokens=96,
                  extra_body={"regex": regex})
    client = thinking_qwen.openai()
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
        (call,) = message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    else:
        reasoning = content = arguments = ""
        name = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or ():
                    name = name or delta.function.name
                    arguments += delta.function.arguments or ""
    assert reasoning.strip() == "The user wants the weather."
    assert content.strip() == "Let me check." and name == "get_weather"
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
