"""A mixture-of-experts model served through the OpenAI SDK: a tiny random Qwen3-MoE with the
default model's tokenizer and chat template, its chat answer (plain and streamed) transformers'
greedy tokens, with the qwen3 reasoning and qwen25 tool-call parsers on as a Qwen3-MoE user
would start it."""
import pytest

from tests.http.conftest import check_chat_and_stream, tiny_family_server

MESSAGES = [{"role": "user", "content": "List 3 countries and their capitals."}]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    running, hf_model = tiny_family_server(tmp_path_factory, "qwen3_moe",
                                           served_model_name="tiny-moe", reasoning_parser="qwen3",
                                           tool_call_parser="qwen25")
    yield running, hf_model
    running.close()


def test_chat_and_its_stream_are_transformers_greedy(moe_server):
    check_chat_and_stream(*moe_server, "tiny-moe", MESSAGES)
