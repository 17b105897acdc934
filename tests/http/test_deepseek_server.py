"""A tiny DeepSeek-V3 (issue 35: multi-head latent attention, DeepSeek's experts) served through
the OpenAI SDK in DeepSeek-V3.1's chat format: plain chat, reasoning under `thinking` with
`--reasoning-parser deepseek-v3`, and tool calls with `--tool-call-parser deepseekv31`, whole
and streamed. The tiny model's weights are random, so a regex constraint makes it write what
DeepSeek-V3.1 writes; the parsers then work on the model's own detokenized output."""
import os

import pytest

from tests.http.conftest import VOCAB, RunningServer
from tests.tiny_models import make_tiny_checkpoint

TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "deepseek-v3.1-format.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
REASONING = "The user wants the weather in Paris."
CALL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from xlaserve.weights.formats import gguf_file
    from xlaserve.weights.loader import default_model_file

    directory = str(tmp_path_factory.mktemp("tiny-deepseek-v3"))
    make_tiny_checkpoint(directory, "deepseek_v3", vocab_size=VOCAB)
    gguf_file.load_tokenizer(default_model_file()).save_pretrained(directory)
    running = RunningServer(directory, served_model_name="tiny-dsv3", chat_template=TEMPLATE,
                            reasoning_parser="deepseek-v3", tool_call_parser="deepseekv31")
    yield running
    running.close()


def _regex(text: str) -> str:
    return "".join("\\" + c if c in "{}.()[]?*+|^$\\" else c for c in text)


def test_the_prompt_is_deepseeks_format_with_the_thinking_switch(deepseek):
    render = deepseek.ctx.tokenizer.apply_chat_template
    template = open(TEMPLATE).read()
    on = render(QUESTION, chat_template=template, tokenize=False, add_generation_prompt=True,
                thinking=True)
    off = render(QUESTION, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert on.endswith("<｜User｜>Weather in Paris?<｜Assistant｜><think>")
    assert off.endswith("<｜Assistant｜></think>")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_a_tool_call_through_the_sdk(deepseek, stream):
    kwargs = dict(model="tiny-dsv3", messages=QUESTION, tools=[WEATHER], temperature=0,
                  max_tokens=96, extra_body={"regex": _regex(REASONING + "</think>" + CALL),
                                             "chat_template_kwargs": {"thinking": True}})
    client = deepseek.openai()
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message
        (call,) = message.tool_calls
        got = (message.reasoning_content, message.content, call.function.name,
               call.function.arguments, choice.finish_reason)
    else:
        reasoning = content = arguments = ""
        name = finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or ():
                    name = call.function.name or name
                    arguments += call.function.arguments or ""
                finish = choice.finish_reason or finish
        got = (reasoning, content or None, name, arguments, finish)
    assert got == (REASONING, None, "get_weather", '{"city": "Paris"}', "tool_calls")


def test_without_thinking_the_answer_is_all_content(deepseek):
    message = deepseek.openai().chat.completions.create(
        model="tiny-dsv3", messages=QUESTION, temperature=0, max_tokens=12,
        extra_body={"regex": "It is sunny in Paris\\."}).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "It is sunny in Paris.")
