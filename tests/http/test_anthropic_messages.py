"""Anthropic's Messages API (/v1/messages, http/messages/) through the official `anthropic` SDK,
which validates every answer strictly here (`_strict_response_validation`), on the tiny model
of the HTTP tests. Greedy outputs are gibberish but deterministic, so a message is compared with
the chat completion of the same conversation."""
import dataclasses
import json

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.http.conftest import AppServer

# The SDK's newest API has no sampling parameters (Anthropic's newest models dropped them); the
# server still takes them, as older clients send them.
ZERO = {"temperature": 0}
GREEDY = {"model": "tiny", "max_tokens": 8, "extra_body": ZERO}
RAW = {"model": "tiny", "max_tokens": 8, **ZERO}  # a body as sent
EVENTS = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def variant(server):
    """Apps over the same engine with other serving options (no second model load)."""
    from xlaserve.http.app import create_app

    started = []

    def start(api_key=None, **changes):
        ctx = dataclasses.replace(server.ctx, **changes)
        started.append(AppServer(create_app(ctx, api_key=api_key), ctx))
        return started[-1]

    yield start
    for running in started:
        running.close()


def sdk(running, api_key="EMPTY") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=running.base_url, api_key=api_key, max_retries=0,
                               _strict_response_validation=True)


@pytest.fixture(scope="module")
def claude(server):
    return sdk(server)


def chat(server, messages: list[dict], **body) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, **body}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def text_of(message: Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def streamed(client, **body) -> tuple[list, Message]:
    """Every event (validated as the SDK's types) and the message the SDK builds from them."""
    events, message, json_bufs = [], None, {}
    with client.messages.create(stream=True, **body) as stream:
        for item in stream:
            events.append(EVENTS.validate_python(item.model_dump(mode="json")))
            message = accumulate_event(event=item, current_snapshot=message, json_bufs=json_bufs)
    return events, message


def test_a_message_answers_like_the_chat_completion_of_the_same_conversation(server, claude):
    message = claude.messages.create(messages=[{"role": "user", "content": "Say hello."}],
                                     system="You are terse.", **GREEDY)
    completion = chat(server, [{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Say hello."}])
    choice, usage = completion["choices"][0], completion["usage"]
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "tiny"
    assert text_of(message) == choice["message"]["content"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    # Anthropic's input_tokens leave out what the cache held: the three make the prompt.
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens \
        + message.usage.cache_creation_input_tokens == usage["prompt_tokens"]
    assert message.usage.output_tokens == usage["completion_tokens"]


def test_a_stream_sends_anthropics_events_in_order_and_builds_the_same_message(claude):
    body = dict(messages=[{"role": "user", "content": "Count to three."}], **GREEDY)
    whole = claude.messages.create(**body)
    events, message = streamed(claude, **body)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:3] == ["content_block_start", "content_block_delta"]  # the SDK drops ping
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert {e.delta.type for e in events if e.type == "content_block_delta"} == {"text_delta"}
    assert events[0].message.usage.input_tokens > 0 and events[0].message.content == []
    assert text_of(message) == text_of(whole)
    assert (message.stop_reason, message.usage.output_tokens) == \
        (whole.stop_reason, whole.usage.output_tokens)


def test_a_stop_sequence_is_named_in_the_answer(claude):
    body = dict(messages=[{"role": "user", "content": "Write a sentence."}], model="tiny",
                max_tokens=12)
    text = text_of(claude.messages.create(extra_body=ZERO, **body))
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    for message in (claude.messages.create(stop_sequences=[stop], extra_body=ZERO, **body),
                    streamed(claude, stop_sequences=[stop], extra_body=ZERO, **body)[1]):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert text.startswith(text_of(message)) and stop not in text_of(message)


def test_blocks_render_the_conversation_as_chat_does(server, claude):
    """Text blocks, an assistant's tool_use and the user's tool_result make the prompt chat makes
    of the same turns: count_tokens, a message's usage and chat's prompt_tokens agree."""
    call_input = {"city": "Paris"}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": call_input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call_input)}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    chat_tool = {"type": "function", "function": {"name": WEATHER["name"],
                 "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}
    completion = chat(server, chat_messages, tools=[chat_tool])
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    counted = claude.messages.count_tokens(model="tiny", messages=messages, system=system,
                                           tools=[WEATHER])
    message = claude.messages.create(messages=messages, system=system, tools=[WEATHER], **GREEDY)
    assert counted.input_tokens == completion["usage"]["prompt_tokens"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted.input_tokens
    assert text_of(message) == completion["choices"][0]["message"]["content"]


def test_a_last_assistant_message_is_a_prefill_the_answer_continues(server, claude):
    turns = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "The colour is"}]
    message = claude.messages.create(messages=turns, **GREEDY)
    completion = chat(server, turns, continue_final_message=True, add_generation_prompt=False)
    assert text_of(message) == completion["choices"][0]["message"]["content"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        completion["usage"]["prompt_tokens"]


def test_system_messages_among_the_messages_render_in_their_place(server, claude):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "system", "content": [{"type": "text", "text": "Now be terse."}]},
             {"role": "user", "content": "Name a colour."}]
    message = claude.messages.create(messages=turns, **GREEDY)
    completion = chat(server, [{**t, "content": "Now be terse."} if t["role"] == "system" else t
                               for t in turns])
    assert text_of(message) == completion["choices"][0]["message"]["content"]


def test_output_config_format_constrains_the_text_to_its_schema(claude):
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
    message = claude.messages.create(
        messages=[{"role": "user", "content": "A colour as JSON."}], model="tiny",
        max_tokens=30, extra_body=ZERO,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(text_of(message))["colour"] in ("red", "green")
    assert message.stop_reason == "end_turn"


def test_max_tokens_0_prefills_the_prompt_and_generates_nothing(claude):
    """Anthropic's cache pre-warming: the prompt goes through the model (into the prefix cache,
    so the next request with it reads it from there) and nothing is generated."""
    turns = [{"role": "user", "content": "A long shared prefix to warm, " * 8}]
    warm = claude.messages.create(messages=turns, model="tiny", max_tokens=0)
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
    again = claude.messages.create(messages=turns, **GREEDY)
    assert again.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_is_a_tool_use_block_with_its_input(claude, stream):
    body = dict(messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather"}, model="tiny",
                max_tokens=40, extra_body=ZERO)
    if stream:
        events, message = streamed(claude, **body)
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert deltas and all(d.type == "input_json_delta" for d in deltas)
    else:
        message = claude.messages.create(**body)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input in ({"city": "Paris"}, {"city": "Rome"}) and block.id
    assert message.stop_reason == "tool_use"


def test_any_tool_and_one_call_at_most(claude):
    message = claude.messages.create(
        messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], model="tiny",
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=ZERO,
        max_tokens=60)
    assert [b.type for b in message.content] == ["tool_use"]
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_a_thinking_block(variant, stream):
    """With a reasoning parser the model's reasoning comes back as a thinking block (streamed:
    thinking_delta); deepseek-r1's starts inside the reasoning, so all of the tiny model's
    output is."""
    running = variant(reasoning_parser="deepseek-r1")
    body = dict(messages=[{"role": "user", "content": "Think."}], thinking={"type": "adaptive"},
                **GREEDY)
    client = sdk(running)
    if stream:
        events, message = streamed(client, **body)
        assert {e.delta.type for e in events if e.type == "content_block_delta"} == \
            {"thinking_delta"}
    else:
        message = client.messages.create(**body)
    (block,) = message.content
    assert block.type == "thinking" and block.thinking
    # A thinking block sent back (with Anthropic's signature) is the assistant's reasoning.
    again = client.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": "Think."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": block.thinking,
                                           "signature": "c2ln"}, {"type": "text", "text": "Hi"}]},
        {"role": "user", "content": "Again."}])
    assert again.input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_display_omitted_gives_the_block_without_its_text(variant, stream):
    running = variant(reasoning_parser="deepseek-r1")
    body = dict(messages=[{"role": "user", "content": "Think."}],
                thinking={"type": "adaptive", "display": "omitted"}, **GREEDY)
    client = sdk(running)
    if stream:
        events, message = streamed(client, **body)
        assert not [e for e in events if e.type == "content_block_delta"]
    else:
        message = client.messages.create(**body)
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", "")]


def test_thinking_settings_are_checked_as_anthropic_checks_them(claude):
    user = [{"role": "user", "content": "Hi"}]
    for thinking, max_tokens, says in (
            ({"type": "enabled", "budget_tokens": 100}, 2000, ">= 1024"),
            ({"type": "enabled", "budget_tokens": 1024}, 1024, "less than max_tokens"),
            ({"type": "sometimes"}, 8, "thinking must be")):
        with pytest.raises(anthropic.BadRequestError) as error:
            claude.messages.create(model="tiny", messages=user, max_tokens=max_tokens,
                                   thinking=thinking)
        assert says in error.value.body["error"]["message"]


def test_what_claude_code_sends_is_answered_and_what_does_nothing_is_named(server):
    """A request shaped as Claude Code sends them (system and tools with cache_control, metadata,
    a context-management field, beta headers, streamed): answered, and the fields that change
    nothing here named in X-Ignored-Fields."""
    body = {"model": "tiny", "max_tokens": 8, "stream": True, "temperature": 0,
            "system": [{"type": "text", "text": "You are Claude Code.",
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": "user_abc_account_1_session_2"},
            "context_management": {"edits": []}, "cache_control": {"type": "ephemeral"},
            "output_config": {"effort": "high"}, "thinking": {"type": "adaptive"},
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]}]}
    headers = {"x-api-key": "EMPTY", "anthropic-version": "2023-06-01",
               "anthropic-beta": "interleaved-thinking-2025-05-14"}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["x-ignored-fields"] == "context_management, cache_control"
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    assert text.startswith("event: message_start\n") and "event: message_stop\n" in text


@pytest.mark.parametrize("body,status,says", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, 400, "max_tokens"),
    ({**RAW, "temperature": 1.5, "messages": [{"role": "user", "content": "Hi"}]}, 400,
     "temperature"),
    ({**RAW, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     400, "'document' are not supported"),
    ({**RAW, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "needs text"),
    ({**RAW, "messages": [{"role": "user", "content": [{"type": "text", "text": "a",
                                                           "colour": 1}]}]}, 400, "colour"),
    ({**RAW, "messages": [{"role": "user", "content": "Hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "only custom tools"),
    ({**RAW, "messages": [{"role": "user", "content": "Hi"}],
      "tool_choice": {"type": "tool"}}, 400, "tool_choice"),
    ({**RAW, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400, "text only"),
    ({**RAW, "max_tokens": 100000, "messages": [{"role": "user", "content": "Hi"}]}, 400, ""),
    ({**RAW, "model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "Hi"}]},
     404, "does not exist"),
])
def test_bad_requests_get_anthropics_error_shape(server, body, status, says):
    response = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error) == {"type", "error"}
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert says in error["error"]["message"]


def test_the_api_key_comes_as_x_api_key_and_a_wrong_one_is_anthropics_401(variant):
    running = variant(api_key="secret")
    assert sdk(running, api_key="secret").messages.create(
        messages=[{"role": "user", "content": "Hi"}], **GREEDY).content is not None
    with pytest.raises(anthropic.AuthenticationError) as error:
        sdk(running, api_key="wrong").messages.create(
            messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    assert error.value.body["error"]["type"] == "authentication_error"
    # OpenAI's routes still take the Bearer key (and Anthropic's header).
    for headers in ({"Authorization": "Bearer secret"}, {"x-api-key": "secret"}):
        assert httpx.get(running.base_url + "/v1/models", headers=headers).status_code == 200


def test_thinking_then_text_then_calls_stream_as_blocks_in_that_order():
    """The stream's conversion (http/messages/stream.py) of a chat stream that reasons, writes
    and calls two tools, as the tool-call parsers send calls: the SDK builds the message the
    non-streamed conversion gives."""
    import asyncio
    import types

    from xlaserve.http.messages import convert
    from xlaserve.http.messages.call import MessageCall
    from xlaserve.http.messages.stream import events

    def chunk(delta=None, finish=None, usage=None):
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                             "matched_stop": None}]
        return {"choices": choices, "usage": usage}

    calls = [{"index": 0, "id": "call_a", "type": "function",
              "function": {"name": "get_weather", "arguments": ""}},
             {"index": 0, "function": {"arguments": '{"city": '}},
             {"index": 0, "function": {"arguments": '"Paris"}'}},
             {"index": 1, "id": "call_b", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Plan"}),
              chunk({"reasoning_content": " it."}), chunk({"content": "Checking."}),
              chunk({"tool_calls": calls[:2]}), chunk({"tool_calls": calls[2:]}),
              chunk({}, "tool_calls"),
              chunk(usage={"prompt_tokens": 9, "completion_tokens": 20, "total_tokens": 29,
                           "prompt_tokens_details": {"cached_tokens": 4}})]

    async def chat_chunks():
        for item in chunks:
            yield item

    call = object.__new__(MessageCall)
    call.ctx = types.SimpleNamespace(served_model_name="tiny")
    call.req = types.SimpleNamespace(stop_sequences=None)
    call.id, call.show_thinking, call.prefill_only = "msg_1", True, False
    call.chat = types.SimpleNamespace(prompt_ids=[0] * 9, chunks=chat_chunks)

    async def collect():
        return [item async for item in events(call)]

    message, json_bufs = None, {}
    raws = asyncio.run(collect())
    assert raws[1] == b'event: ping\ndata: {"type":"ping"}\n\n'
    for raw in raws[:1] + raws[2:]:
        kind, data = raw.decode().split("\n")[:2]
        item = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {item.type}"
        message = accumulate_event(event=item, current_snapshot=message, json_bufs=json_bufs)
    expected = convert.content_blocks({
        "reasoning_content": "Plan it.", "content": "Checking.",
        "tool_calls": [{"id": "call_a", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Paris"}'}},
                       {"id": "call_b", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Rome"}'}}]})
    assert [b.model_dump(exclude_none=True) for b in message.content] == expected
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
            message.usage.output_tokens) == (5, 4, 20)
