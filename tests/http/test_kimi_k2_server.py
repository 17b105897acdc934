"""Kimi K2's tokenizer (issue 35): a tiktoken file and the checkpoint's own Python class
(`tokenization_kimi.TikTokenTokenizer`, a slow tokenizer), which transformers imports only under
`--trust-remote-code`. A tiny DeepSeek-V3 (Kimi K2's architecture) with a tokenizer of that shape
(tests/http/kimi: Kimi's own 163,840-token file is not available offline) serves chat in Kimi's
format, streamed text equal to the whole, a structured output (llguidance over the tokenizer's
tiktoken encoding), and `kimi_k2` tool calls and reasoning on the model's own output."""
import json

import pytest

from tests.http.conftest import RunningServer
from tests.http.kimi import write_tokenizer
from tests.tiny_models import make_tiny_checkpoint

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')


@pytest.fixture(scope="module")
def kimi_checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-kimi-k2"))
    vocab = write_tokenizer(directory)
    make_tiny_checkpoint(directory, "deepseek_v3", vocab_size=vocab)
    return directory


@pytest.fixture(scope="module")
def kimi(kimi_checkpoint):
    running = RunningServer(kimi_checkpoint, served_model_name="tiny-kimi",
                            trust_remote_code=True, reasoning_parser="kimi_k2",
                            tool_call_parser="kimi_k2")
    yield running
    running.close()


def _regex(text: str) -> str:
    return "".join("\\" + c if c in "{}.()[]?*+|^$\\" else c for c in text)


def test_the_remote_tokenizer_needs_trust_remote_code(kimi_checkpoint):
    from xlaserve.weights.loader import load_model

    with pytest.raises(ValueError, match="--trust-remote-code"):
        load_model(kimi_checkpoint, dtype="float32", progress=False)


def test_chat_in_kimis_format_streamed_as_whole(kimi):
    tokenizer = kimi.ctx.tokenizer
    assert type(tokenizer).__name__ == "TikTokenTokenizer" and not tokenizer.is_fast
    client = kimi.openai()
    kwargs = dict(model="tiny-kimi", messages=QUESTION, temperature=0, max_tokens=12,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
                      "<|im_assistant|>assistant<|im_middle|>")
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == 12
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**kwargs, stream=True) if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_a_structured_output_over_the_tiktoken_vocabulary(kimi):
    # Multi-byte text (Han characters split into byte tokens) and JSON, through llguidance's
    # table of the tokenizer's tiktoken encoding.
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["巴黎", "Paris"]}},
              "required": ["city"], "additionalProperties": False}
    response = kimi.openai().chat.completions.create(
        model="tiny-kimi", messages=QUESTION, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert json.loads(response.choices[0].message.content)["city"] in ("巴黎", "Paris")


@pytest.mark.parametrize("stream", [False, True])
def test_kimi_k2_reasoning_then_tool_call(kimi, stream):
    reasoning = "The user asks about Paris."
    kwargs = dict(model="tiny-kimi", messages=QUESTION, tools=[WEATHER], temperature=0,
                  max_tokens=200, extra_body={"regex": _regex("<think>" + reasoning + "</think>" + CALL)})
    client = kimi.openai()
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        (call,) = message.tool_calls
        got = (message.reasoning_content, call.id, call.function.name,
               json.loads(call.function.arguments))
    else:
        text, calls = "", {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is None:
                continue
            text += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        (call,) = calls.values()
        got = (text, call["id"], call["name"], json.loads(call["arguments"]))
    assert got == (reasoning, "functions.get_weather:0", "get_weather", {"city": "Paris"})


def test_tokenizer_code_that_does_not_import_is_one_line_at_start_up(tmp_path):
    from xlaserve.weights.loader import load_tokenizer

    write_tokenizer(str(tmp_path), base_size=300)
    code = tmp_path / "tokenization_kimi.py"
    code.write_text("from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode\n"
                    + code.read_text())
    with pytest.raises(ValueError, match=r"tokenization_kimi.TikTokenTokenizer\) does not import "
                                         r"with transformers 5\..*bytes_to_unicode"):
        load_tokenizer(str(tmp_path), trust_remote_code=True)
