"""OpenAI's Responses API (/v1/responses, http/responses/) through the official `openai` SDK on
the tiny model of the HTTP tests: every answer is validated strictly with the SDK's own pydantic
types (the SDK itself builds its objects without validating). Greedy outputs are gibberish but
deterministic, so a response is compared with the chat completion of the same conversation."""
import dataclasses
import json
import time

import httpx
import jsonschema
import pytest
from openai import BadRequestError, NotFoundError
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.http.conftest import AppServer

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 8}
EVENTS = TypeAdapter(ResponseStreamEvent)
ITEMS = TypeAdapter(ResponseItem)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False,
                          "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"]}}
FINITE = {"type": "object", "additionalProperties": False,
          "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"]}


def validated(response) -> Response:
    """The SDK's object re-validated strictly from the JSON the server sent."""
    return Response.model_validate(response.model_dump(mode="json", by_alias=True))


def text_of(response: Response) -> str:
    return "".join(part.text for item in response.output if item.type == "message"
                   for part in item.content)


def chat(client, messages: list[dict], **body):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                          max_completion_tokens=8, **body)


def test_a_string_input_answers_like_the_chat_completion_of_one_user_message(client):
    response = validated(client.responses.create(input="Say hello.", **GREEDY))
    completion = chat(client, [{"role": "user", "content": "Say hello."}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == ("incomplete" if completion.choices[0].finish_reason == "length"
                               else "completed")
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert text_of(response) == completion.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) \
        == (completion.usage.prompt_tokens, completion.usage.completion_tokens,
            completion.usage.total_tokens)
    assert response.output_text == text_of(response)  # the SDK's own property


def test_items_with_instructions_render_as_a_system_message_then_the_conversation(client):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "Name a colour."}]
    response = validated(client.responses.create(input=items, instructions="You are terse.",
                                                 **GREEDY))
    completion = chat(client, [{"role": "system", "content": "You are terse."},
                               {"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello!"},
                               {"role": "user", "content": "Name a colour."}])
    assert response.instructions == "You are terse."
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert text_of(response) == completion.choices[0].message.content


def test_reasoning_effort_goes_through_chats_reasoning_effort(client):
    response = validated(client.responses.create(input="Hi", reasoning={"effort": "none"},
                                                 **GREEDY))
    completion = chat(client, [{"role": "user", "content": "Hi"}], reasoning_effort="none")
    assert response.reasoning.effort == "none"
    assert text_of(response) == completion.choices[0].message.content
    assert response.usage.input_tokens == completion.usage.prompt_tokens


def test_max_output_tokens_cuts_the_response_to_incomplete(client):
    response = validated(client.responses.create(input="Count.", model="tiny", temperature=0,
                                                 max_output_tokens=2))
    if response.usage.output_tokens == 2:  # it did not end on its own first
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"


def test_stored_responses_are_retrieved_and_deleted_and_unknown_ones_are_404(client):
    created = client.responses.create(input="Keep this.", metadata={"k": "v"}, **GREEDY)
    retrieved = validated(client.responses.retrieve(created.id))
    assert retrieved.model_dump() == validated(created).model_dump()
    assert retrieved.metadata == {"k": "v"}
    items = client.responses.input_items.list(created.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == \
        [("message", "user", "Keep this.")]
    ITEMS.validate_python(items.data[0].model_dump(mode="json", by_alias=True))
    client.responses.delete(created.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve("resp_nope")


def test_store_false_responses_cannot_be_retrieved(client):
    created = client.responses.create(input="Forget this.", store=False, **GREEDY)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(NotFoundError):
        client.responses.create(input="And?", previous_response_id=created.id, **GREEDY)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input="My name is Ada.", instructions="Be kind.", **GREEDY)
    second = validated(client.responses.create(input="What is my name?",
                                               previous_response_id=first.id, **GREEDY))
    # The instructions are not carried over (OpenAI's rule); the first exchange is.
    completion = chat(client, [{"role": "user", "content": "My name is Ada."},
                               {"role": "assistant", "content": text_of(first)},
                               {"role": "user", "content": "What is my name?"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == completion.usage.prompt_tokens
    assert text_of(second) == completion.choices[0].message.content
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [(item.role, item.content[0].text) for item in listed.data] == \
        [("user", "My name is Ada."), ("assistant", text_of(first)), ("user", "What is my name?")]
    for item in listed.data:
        ITEMS.validate_python(item.model_dump(mode="json", by_alias=True))
    page = client.responses.input_items.list(second.id, limit=1, after=listed.data[2].id)
    assert [item.id for item in page.data] == [listed.data[1].id] and page.has_more


def test_a_continued_conversation_is_bounded_by_max_payload_size(server, client, monkeypatch):
    first = client.responses.create(input=[{"role": "user", "content": "x" * 1200,
                                            "extra": "dropped"}], **GREEDY)
    engine = server.ctx.engine
    monkeypatch.setattr(engine, "server_args", dataclasses.replace(engine.server_args,
                                                                   max_payload_size=1200))
    with pytest.raises(BadRequestError) as refused:
        client.responses.create(input="more", previous_response_id=first.id, **GREEDY)
    assert refused.value.body["param"] == "previous_response_id"
    [item] = client.responses.input_items.list(first.id).data
    assert "extra" not in item.model_dump()  # only what the prompt holds is stored


def test_streamed_events_come_in_order_and_their_deltas_make_the_greedy_text(server, client):
    expected = client.responses.create(input="Tell a story.", **GREEDY)
    events = [EVENTS.validate_python(e.model_dump(mode="json", by_alias=True))
              for e in client.responses.create(input="Tell a story.", stream=True, **GREEDY)]
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{expected.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == text_of(expected) == events[-4].text
    final = validated(events[-1].response)
    assert final.status == expected.status and text_of(final) == text
    assert final.usage.output_tokens == expected.usage.output_tokens
    assert text_of(validated(client.responses.retrieve(final.id))) == text


def wait_until_idle(server, seconds: float = 5) -> int:
    """The engine's running requests once they are gone, or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while server.ctx.core.scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.ctx.core.scheduler.num_running


def finished_requests(server) -> float:
    """Requests that ran to their end (an aborted one is not counted)."""
    metrics = httpx.get(server.base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("xlaserve:num_requests_total"))


def test_a_stream_the_client_leaves_is_aborted_and_not_stored(server):
    finished = finished_requests(server)
    body = {"model": "tiny", "input": "Talk a lot.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=30) as sse:
        lines = sse.iter_lines()
        created = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        next(line for line in lines if "response.output_text.delta" in line)
    assert wait_until_idle(server) == 0 and finished_requests(server) == finished
    missing = httpx.get(f"{server.base_url}/v1/responses/{created['response']['id']}")
    assert missing.status_code == 404


def test_the_sdk_stream_helper_accumulates_the_same_response(client):
    # The helper wants `response.completed`: a finite JSON schema makes the gibberish end.
    text = {"format": {"type": "json_schema", "name": "pick", "schema": FINITE, "strict": True}}
    body = {"input": "A colour?", "text": text, "model": "tiny", "temperature": 0,
            "max_output_tokens": 40}
    expected = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert expected.status == final.status == "completed"
    assert deltas == final.output_text == expected.output_text
    jsonschema.validate(json.loads(deltas), FINITE)


def test_a_forced_function_call_round_trips_through_function_call_output(client):
    first = validated(client.responses.create(input="Weather in Paris?", tools=[WEATHER],
                                              tool_choice="required", model="tiny",
                                              temperature=0, max_output_tokens=40))
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"
    second = validated(client.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        previous_response_id=first.id, tools=[WEATHER], **GREEDY))
    completion = chat(client, [{"role": "user", "content": "Weather in Paris?"},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": call.call_id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}]},
                               {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
                      tools=[{"type": "function", "function": {
                          k: v for k, v in WEATHER.items() if k != "type"}}])
    assert second.usage.input_tokens == completion.usage.prompt_tokens
    # Streamed, the call comes as a function_call item with its arguments.
    events = list(client.responses.create(input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          model="tiny", temperature=0, max_output_tokens=40,
                                          stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
    assert validated(events[-1].response).output[0].arguments == done[0].arguments


def test_text_format_json_schema_output_validates(client):
    schema = FINITE
    response = validated(client.responses.create(
        input="A colour?", text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                                            "strict": True}},
        model="tiny", temperature=0, max_output_tokens=40))
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "pick"


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),
])
def test_bad_requests_get_an_openai_error_naming_the_parameter(server, change, param):
    body = {"model": "tiny", "input": "hi", **change}
    response = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.text


def test_a_finished_response_cannot_be_cancelled_but_a_background_one_can(client, server):
    done = client.responses.create(input="hi", **GREEDY)
    with pytest.raises(BadRequestError):
        client.responses.cancel(done.id)
    finished = finished_requests(server)
    running = client.responses.create(input="Talk a lot.", background=True, model="tiny",
                                      max_output_tokens=400)
    assert running.status == "in_progress" and running.background
    cancelled = validated(client.responses.cancel(running.id))  # 400 tokens take over a second
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert validated(client.responses.retrieve(running.id)).status == "cancelled"
    assert validated(client.responses.cancel(running.id)).status == "cancelled"  # idempotent
    assert wait_until_idle(server) == 0 and finished_requests(server) == finished  # aborted


def test_a_background_response_is_polled_until_it_finishes(client):
    created = client.responses.create(input="hi", background=True, **GREEDY)
    deadline = time.monotonic() + 60
    while (current := client.responses.retrieve(created.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    expected = client.responses.create(input="hi", **GREEDY)
    assert validated(current).output_text == expected.output_text


@pytest.fixture
def app_over(server, tmp_path):
    """-> start(folder, **ctx changes): an app over the session engine with its own storage."""
    from xlaserve.http.app import create_app
    from xlaserve.http.batches.runner import BatchRunner
    from xlaserve.http.batches.storage import Storage

    started = []

    def start(folder, **changes):
        ctx = dataclasses.replace(server.ctx, **changes)
        runner = BatchRunner(ctx, Storage(str(folder)), max_file_size=1 << 20, max_lines=10,
                             concurrency=2)
        started.append(AppServer(create_app(ctx, batch_runner=runner), ctx))
        return started[-1]

    yield start
    for running in started:
        running.close()


def test_previous_response_id_survives_a_restart(app_over, tmp_path):
    first_app = app_over(tmp_path)
    first = first_app.openai().responses.create(input="Remember 7.", **GREEDY)
    first_app.close()
    again = app_over(tmp_path).openai()
    assert validated(again.responses.retrieve(first.id)).output_text == first.output_text
    second = again.responses.create(input="Which number?", previous_response_id=first.id, **GREEDY)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_background_responses_a_stop_cut_off_are_failed_at_the_next_start(app_over, tmp_path):
    from xlaserve.http.batches.storage import Storage

    storage = Storage(str(tmp_path))
    stale = {"id": "resp_stale", "object": "response", "created_at": 1, "status": "in_progress",
             "model": "tiny", "output": [], "parallel_tool_calls": True, "tool_choice": "auto",
             "tools": [], "background": True, "error": None, "_input": []}
    storage.save_response(stale)
    storage.close()
    failed = validated(app_over(tmp_path).openai().responses.retrieve("resp_stale"))
    assert failed.status == "failed" and failed.error.code == "server_error"


def test_a_reasoning_parser_gives_a_reasoning_item_streamed_and_not(app_over, tmp_path):
    # deepseek-r1's output starts inside its thinking block: the gibberish is all reasoning.
    client = app_over(tmp_path, reasoning_parser="deepseek-r1").openai()
    response = validated(client.responses.create(input="Think.", **GREEDY))
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text and response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(input="Think.", stream=True, **GREEDY))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed.strip() == reasoning.content[0].text  # the whole text is parsed stripped
    assert validated(events[-1].response).output[0].content[0].text == streamed
