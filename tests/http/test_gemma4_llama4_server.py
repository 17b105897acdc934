"""Gemma 4's and Llama 4's tool-call and reasoning parsers through the server and the `openai`
SDK (issue 74): the tiny chat model is made (by a regex) to write exactly what the models write,
`--tool-call-parser gemma4 --reasoning-parser gemma4` and `--tool-call-parser llama4_json` turn it
into `reasoning_content`, `content` and `tool_calls`, whole and streamed; a malformed call comes
back as text with a 200. The markers are special tokens of those models: a chat request with these
parsers keeps special tokens in the text it parses. (The tiny model's tokenizer has no such
special tokens, so here they come as text: the same text the parsers see.)"""
from __future__ import annotations

import dataclasses
import json

import pytest

from tests.http import test_chat_templates_and_reasoning
from xlaserve.http.protocol import ChatCompletionRequest

variant = test_chat_templates_and_reasoning.variant  # a fixture: apps over the session's engine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
Q = '<|"|>'
GEMMA4_OUTPUT = ("<|channel>thought\nThe user wants the weather.<channel|>Let me check."
                 f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}celsius{Q}}}<tool_call|>"
                 f"<|tool_call>call:get_time{{timezone:{Q}Europe/Paris{Q}}}<tool_call|>")
LLAMA4_OUTPUT = ('<|python_start|>Let me check.<|python_end|>{"name": "get_weather", "parameters": '
                 '{"city": "Paris", "unit": "celsius"}}{"name": "get_time", "parameters": '
                 '{"timezone": "Europe/Paris"}}')
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]


def _regex(text: str) -> str:
    return "".join("\\" + c if c in "{}.()[]?*+|^$\\" else c for c in text)


def _ask(app, output: str, stream: bool) -> tuple[str | None, str, list, str]:
    """(reasoning, content, [(name, arguments)], finish_reason) of a reply forced to `output`."""
    kwargs = dict(model="tiny", messages=QUESTION, tools=[WEATHER, TIME], temperature=0,
                  max_tokens=200, extra_body={"regex": _regex(output)})
    client = app.openai()
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]
        assert all(c.id.startswith("call_") for c in message.tool_calls or ())
        return message.reasoning_content, message.content or "", calls, choice.finish_reason
    reasoning, content, calls, finish = None, "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None)
            if piece is not None:
                reasoning = (reasoning or "") + piece
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], finish


@pytest.mark.parametrize("stream", [False, True])
def test_gemma4_thinks_then_calls_two_tools(variant, stream):
    app = variant(tool_call_parser="gemma4", reasoning_parser="gemma4")
    reasoning, content, calls, finish = _ask(app, GEMMA4_OUTPUT, stream)
    assert (reasoning.strip(), content.strip(), calls, finish) == (
        "The user wants the weather.", "Let me check.", CALLS, "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_llama4_json_calls_as_llama4s_template_writes_them(variant, stream):
    app = variant(tool_call_parser="llama4_json")
    reasoning, content, calls, finish = _ask(app, LLAMA4_OUTPUT, stream)
    assert (reasoning, content.strip(), calls, finish) == (None, "Let me check.", CALLS, "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_gemma4_call_is_text_with_a_200(variant, stream):
    app = variant(tool_call_parser="gemma4", reasoning_parser="gemma4")
    broken = f"Sure.<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>"
    reasoning, content, calls, finish = _ask(app, broken, stream)
    assert (reasoning, content, calls, finish) == (None, broken, [], "stop")


@pytest.mark.parametrize("tool_parser, reasoning_parser, kept", [
    ("gemma4", None, True), ("llama4_json", None, True), (None, "gemma4", True),
    ("llama4", None, False), ("pythonic", None, False),
])
def test_these_parsers_keep_special_tokens_in_the_text(server, tool_parser, reasoning_parser, kept):
    from xlaserve.http.chat import ChatCall

    ctx = dataclasses.replace(server.ctx, tool_call_parser=tool_parser, reasoning_parser=reasoning_parser)
    call = ChatCall(ctx, ChatCompletionRequest(messages=QUESTION, tools=[WEATHER], max_tokens=4))
    assert call.params.skip_special_tokens is (not kept)
