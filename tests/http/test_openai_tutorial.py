"""SGLang's "OpenAI APIs - Completions" tutorial, cell by cell, through the official `openai` SDK,
unchanged but for the base URL and the model name; each cell then checks its answer."""
from tests.hf_reference import hf_greedy

MODEL = "tiny"


def _chat_prompt_ids(server, messages):
    return server.ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    return_dict=False)


def test_cell_chat_completions_is_transformers_greedy(server, client, tiny_chat_model):
    messages = [{"role": "user", "content": "List 3 countries and their capitals."}]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              max_tokens=64)
    choice = response.choices[0]
    prompt_ids = _chat_prompt_ids(server, messages)
    expected = hf_greedy(tiny_chat_model[1], prompt_ids, 64)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.index == 0
    assert response.usage.prompt_tokens == len(prompt_ids)
    if choice.finish_reason == "length":
        assert response.usage.completion_tokens == 64
        assert choice.message.content == server.ctx.tokenizer.decode(expected, skip_special_tokens=True)
    else:  # the model sampled an end of turn: everything up to it
        assert choice.finish_reason == "stop" and choice.matched_stop in expected
        assert expected.index(choice.matched_stop) == response.usage.completion_tokens - 1


def test_cell_detailed_chat_with_system_and_assistant_turns_penalties_and_seed(server, client):
    messages = [
        {"role": "system", "content": "You are a knowledgeable historian who provides concise responses."},
        {"role": "user", "content": "Tell me about ancient Rome"},
        {"role": "assistant", "content": "Ancient Rome was a civilization centered in Italy."},
        {"role": "user", "content": "What were their major achievements?"},
    ]
    kwargs = dict(model=MODEL, messages=messages, temperature=0.3, max_tokens=128, top_p=0.8,
                  presence_penalty=0.2, frequency_penalty=0.2, n=1, seed=42)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert first.choices[0].message.content == again.choices[0].message.content  # the seed
    assert first.usage.prompt_tokens == len(_chat_prompt_ids(server, messages))
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert 1 <= first.usage.completion_tokens <= 128


def _generated_tokens(server) -> float:
    return server.ctx.metrics.generation_tokens.labels("tiny")._value.get()


def test_cell_streaming_chat_without_max_tokens_runs_to_the_context_end(server, client):
    before = _generated_tokens(server)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say this is a test"}], stream=True)
    pieces, finishes = [], []
    for chunk in stream:
        if chunk.choices[0].delta.content is not None:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices[0].finish_reason is not None:
            finishes.append(chunk.choices[0].finish_reason)
    assert finishes in (["length"], ["stop"]) and "".join(pieces)
    prompt_len = len(_chat_prompt_ids(server, [{"role": "user", "content": "Say this is a test"}]))
    if finishes == ["length"]:  # no max_tokens: the rest of the context (512 tokens)
        assert _generated_tokens(server) - before == 512 - prompt_len


def test_cell_completions_is_transformers_greedy(server, client, tiny_chat_model):
    prompt = "List 3 countries and their capitals."
    response = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=64,
                                         n=1, stop=None)
    prompt_ids = server.ctx.tokenizer.encode(prompt)
    expected = hf_greedy(tiny_chat_model[1], prompt_ids, 64)
    assert response.object == "text_completion"
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].text == server.ctx.tokenizer.decode(expected, skip_special_tokens=True)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 64)


def test_cell_detailed_completions_with_a_stop_list(client):
    response = client.completions.create(
        model=MODEL, prompt="Write a short story about a space explorer.", temperature=0.7,
        max_tokens=150, top_p=0.9, frequency_penalty=0.3, presence_penalty=0.3, n=1, seed=123,
        stop=["\n\n", "###"])
    choice = response.choices[0]
    assert "\n\n" not in choice.text and "###" not in choice.text
    if choice.finish_reason == "stop":
        assert choice.matched_stop in ("\n\n", "###") or isinstance(choice.matched_stop, int)
    else:
        assert choice.finish_reason == "length" and response.usage.completion_tokens == 150


def test_models_list_shows_the_served_model_with_its_context(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 512
    assert client.models.retrieve(MODEL).id == MODEL
