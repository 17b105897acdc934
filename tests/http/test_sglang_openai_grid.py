"""SGLang's own OpenAI-server checks (test/srt/openai_server/basic/test_openai_server.py, class
TestOpenAIServer), re-expressed for this server through the official SDK: the completions grid
echo x logprobs x list prompt x n x token-id prompt, streamed and not, and chat's logprobs x n.
What SGLang's test asserts is asserted here, plus what makes a stream equal its plain answer:
one finish_reason per choice, the same text, one logprob entry per token."""
import itertools

import pytest

PROMPT = "The capital of France is"
GRID = list(itertools.product([False, True], [None, 5], [False, True], [1, 2], [False, True]))
GRID_IDS = [f"echo={e}-logprobs={lp}-list={li}-n={n}-ids={ids}" for e, lp, li, n, ids in GRID]
MESSAGES = [{"role": "system", "content": "You are a helpful AI assistant"},
            {"role": "user", "content": "What is the capital of France?"}]


def _prompt(server, use_list: bool, token_ids: bool):
    """(the prompt argument, its choices before n, its prompt tokens)."""
    ids = server.ctx.tokenizer.encode(PROMPT)
    one = ids if token_ids else PROMPT
    return ([one, one], 2, 2 * len(ids)) if use_list else (one, 1, len(ids))


@pytest.mark.parametrize("echo,logprobs,use_list,n,token_ids", GRID, ids=GRID_IDS)
def test_completion_grid_answers_as_sglangs_test_expects(server, client, echo, logprobs,
                                                         use_list, n, token_ids):
    prompt, num_prompts, prompt_tokens = _prompt(server, use_list, token_ids)
    response = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=32,
                                         echo=echo, logprobs=logprobs, n=n)
    assert len(response.choices) == num_prompts * n
    assert sorted(c.index for c in response.choices) == list(range(num_prompts * n))
    first = response.choices[0]
    if echo:
        assert first.text.startswith(PROMPT)
    if logprobs:
        assert isinstance(first.logprobs.tokens[0], str)
        assert isinstance(first.logprobs.top_logprobs[1], dict)
        assert len(first.logprobs.top_logprobs[1]) > 0
        if not echo:  # with echo, the first prompt token has no logprob (None)
            assert first.logprobs.token_logprobs[0]
    else:
        assert first.logprobs is None
    assert response.id and response.created
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens > 0 and response.usage.total_tokens > 0


@pytest.mark.parametrize("echo,logprobs,use_list,n,token_ids", GRID, ids=GRID_IDS)
def test_completion_stream_grid_has_logprobs_on_every_chunk(server, client, echo, logprobs,
                                                            use_list, n, token_ids):
    prompt, num_prompts, _ = _prompt(server, use_list, token_ids)
    kwargs = dict(model="tiny", prompt=prompt, temperature=0, max_tokens=32, echo=echo,
                  logprobs=logprobs, n=n)
    stream = client.completions.create(**kwargs, stream=True,
                                       stream_options={"include_usage": True})
    texts, entries, finishes, firsts = {}, {}, {}, set()
    usages = []
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens > 0 and chunk.usage.completion_tokens > 0
            usages.append(chunk.usage)
            continue
        assert chunk.id and chunk.created
        choice = chunk.choices[0]
        is_first = choice.index not in firsts
        firsts.add(choice.index)
        if logprobs:  # SGLang's check, on every chunk: entries, alternatives after the echo
            assert choice.logprobs, "no logprobs in a chunk"
            assert isinstance(choice.logprobs.tokens[0], str)
            if not (is_first and echo):
                assert isinstance(choice.logprobs.top_logprobs[0], dict)
                assert len(choice.logprobs.top_logprobs[0]) > 0
            entries[choice.index] = entries.get(choice.index, 0) + len(choice.logprobs.tokens)
        else:
            assert choice.logprobs is None
        if is_first and echo:
            assert choice.text.startswith(PROMPT)
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = finishes.get(choice.index, 0) + 1
    indices = list(range(num_prompts * n))
    assert sorted(firsts) == indices and finishes == {i: 1 for i in indices}
    assert len(usages) == 1
    plain = client.completions.create(**kwargs)
    for c in plain.choices:  # the stream is the plain answer cut into pieces
        assert texts[c.index] == c.text
        if logprobs:
            assert entries[c.index] == len(c.logprobs.tokens)


@pytest.mark.parametrize("logprobs,n", list(itertools.product([None, 5], [1, 2])))
def test_chat_grid_answers_as_sglangs_test_expects(client, logprobs, n):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                              max_tokens=32, logprobs=bool(logprobs),
                                              top_logprobs=logprobs, n=n)
    assert len(response.choices) == n
    if logprobs:
        assert isinstance(response.choices[0].logprobs.content[0].top_logprobs[0].token, str)
        assert len(response.choices[0].logprobs.content[0].top_logprobs) == logprobs
    assert response.choices[0].message.role == "assistant"
    assert isinstance(response.choices[0].message.content, str)
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens > 0


@pytest.mark.parametrize("logprobs,n", list(itertools.product([None, 5], [1, 2])))
def test_chat_stream_grid_has_logprobs_until_its_one_finish_chunk(client, logprobs, n):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                            max_tokens=32, logprobs=bool(logprobs),
                                            top_logprobs=logprobs, n=n, stream=True,
                                            stream_options={"include_usage": True})
    firsts, finishes, entries = set(), {}, {}
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens > 0 and chunk.usage.completion_tokens > 0
            continue
        choice = chunk.choices[0]
        if choice.finish_reason is not None:
            finishes[choice.index] = finishes.get(choice.index, 0) + 1
        if choice.index not in firsts:
            assert choice.delta.role == "assistant"
            firsts.add(choice.index)
            continue
        if logprobs and choice.index not in finishes:  # SGLang's check, before the finish
            assert len(choice.logprobs.content[0].top_logprobs) == logprobs
            assert isinstance(choice.logprobs.content[0].top_logprobs[0].token, str)
            entries[choice.index] = entries.get(choice.index, 0) + len(choice.logprobs.content)
        delta = choice.delta
        reasoning = getattr(delta, "reasoning_content", None)  # the SDK's delta lacks the field
        assert (isinstance(delta.content, str) or isinstance(reasoning, str) or delta.tool_calls
                or choice.finish_reason), chunk
    assert sorted(firsts) == list(range(n)) and finishes == {i: 1 for i in range(n)}
    if logprobs:
        plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                               max_tokens=32, logprobs=True, top_logprobs=logprobs,
                                               n=n)
        assert entries == {c.index: len(c.logprobs.content) for c in plain.choices}
