"""A mixture-of-experts model served through the OpenAI SDK: a tiny random Qwen3-MoE with the
default model's tokenizer and chat template, its chat answer (plain and streamed) transformers'
greedy tokens, with the qwen3 reasoning and qwen25 tool-call parsers on as a Qwen3-MoE user
would start it."""
import pytest

from tests.hf_reference import hf_greedy
from tests.http.conftest import tiny_family_server

MESSAGES = [{"role": "user", "content": "List 3 countries and their capitals."}]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    running, hf_model = tiny_family_server(tmp_path_factory, "qwen3_moe",
                                           served_model_name="tiny-moe", reasoning_parser="qwen3",
                                           tool_call_parser="qwen25")
    yield running, hf_model
    running.close()


def test_chat_and_its_stream_are_transformers_greedy(moe_server):
    server, hf_model = moe_server
    client = server.openai()
    prompt_ids = server.ctx.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                          return_dict=False)
    expected = server.ctx.tokenizer.decode(hf_greedy(hf_model, prompt_ids, 16),
                                           skip_special_tokens=True)
    response = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, temperature=0,
                                              max_tokens=16)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 16 and response.choices[0].finish_reason == "length"
    # The parsers find no <think> or <tool_call> in random text: it is all content.
    assert response.choices[0].message.content == expected
    stream = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, temperature=0,
                                            max_tokens=16, stream=True)
    pieces = [chunk.choices[0].delta.content for chunk in stream
              if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(pieces) == expected
