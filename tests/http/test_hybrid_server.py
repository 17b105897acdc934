"""A hybrid linear-attention model served through the OpenAI SDK (issue 76): a tiny random
Qwen3-Next (Gated DeltaNet layers, a gated full-attention layer, experts) with the default model's
tokenizer and chat template, started as a Qwen3-Next user would (qwen3 reasoning, qwen25 tools):
its chat answer, plain and streamed, is transformers' greedy tokens; a conversation's second turn
is served from the first's cached prefix (its linear layers' state snapshot), with transformers'
tokens; /generate answers by token ids."""
import httpx
import pytest

from tests.hf_reference import hf_greedy
from tests.http.conftest import check_chat_and_stream, greedy_chat, tiny_family_server

MESSAGES = [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
            {"role": "user", "content": "List 3 countries and their capitals."}]


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    running, hf_model = tiny_family_server(tmp_path_factory, "qwen3_next",
                                           served_model_name="tiny-next", reasoning_parser="qwen3",
                                           tool_call_parser="qwen25")
    yield running, hf_model
    running.close()


def test_chat_its_stream_and_a_second_turn_are_transformers_greedy(hybrid_server):
    server, hf_model = hybrid_server
    prompt_ids, expected = check_chat_and_stream(server, hf_model, "tiny-next", MESSAGES)
    turn = MESSAGES + [{"role": "assistant", "content": expected},
                       {"role": "user", "content": "And their populations?"}]
    _, expected_next = greedy_chat(server, hf_model, turn, 12)
    second = server.openai().chat.completions.create(model="tiny-next", messages=turn,
                                                     temperature=0, max_tokens=12)
    assert second.choices[0].message.content == expected_next
    # From the first turn's prompt, snapshotted at its last whole page.
    assert second.usage.prompt_tokens_details.cached_tokens > len(prompt_ids) // 2


def test_native_generate_by_token_ids(hybrid_server):
    server, hf_model = hybrid_server
    ids = [5, 17, 300, 42, 9, 77, 120, 3, 250, 11]
    reply = httpx.post(f"{server.base_url}/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                              "ignore_eos": True}}, timeout=60).json()
    assert reply["output_ids"] == hf_greedy(hf_model, ids, 8)
