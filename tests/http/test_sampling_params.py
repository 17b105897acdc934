"""Every sampling parameter of chat and completions does what OpenAI / SGLang document: each test
would fail if its parameter were ignored."""
import threading

import httpx

import numpy as np
import torch

EOS = 2  # <|im_end|>: the tokenizer's EOS and the chat template's end of turn
TOKEN = 1234
USER = [{"role": "user", "content": "Tell me a story about a cat."}]
NO_EOS = {"logit_bias": {str(EOS): -100}}


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=kwargs.pop("messages", USER), **kwargs)


def test_logit_bias_forces_a_token(server, client):
    reply = chat(client, max_tokens=5, temperature=1.0, logit_bias={str(TOKEN): 100})
    assert reply.choices[0].message.content == server.ctx.tokenizer.decode([TOKEN] * 5)


def test_max_tokens_and_max_completion_tokens_are_exact(client):
    for key in ("max_tokens", "max_completion_tokens"):
        reply = chat(client, temperature=0, extra_body=NO_EOS, **{key: 7})
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 7 and reply.choices[0].matched_stop is None


def test_eos_stops_with_matched_stop_the_token_id(client):
    reply = chat(client, max_tokens=10, logit_bias={str(EOS): 100})
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.matched_stop, choice.message.content) == ("stop", EOS, "")
    assert reply.usage.completion_tokens == 1


def test_min_tokens_suppresses_eos_until_reached(client):
    reply = chat(client, max_tokens=10, logit_bias={str(EOS): 100}, extra_body={"min_tokens": 5})
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].matched_stop == EOS
    assert reply.usage.completion_tokens == 6  # five suppressed, then the EOS itself


def test_ignore_eos_runs_to_max_tokens(client):
    reply = chat(client, max_tokens=4, logit_bias={str(EOS): 100}, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


def test_stop_token_ids_stop_and_are_reported(client):
    reply = chat(client, max_tokens=10, logit_bias={str(TOKEN): 100},
                 extra_body={"stop_token_ids": [TOKEN]})
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.matched_stop, reply.usage.completion_tokens) == ("stop", TOKEN, 1)


def _greedy_text(client, n_tokens=24):
    return chat(client, temperature=0, max_tokens=n_tokens, extra_body=NO_EOS).choices[0].message.content


def _stop_in(text: str) -> str:
    """A piece of `text` from its middle whose first occurrence is where we took it."""
    for start in range(len(text) // 3, len(text) - 4):
        piece = text[start:start + 3]
        if text.find(piece) == start and piece.strip():
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_are_trimmed_and_reported_also_when_streamed(client):
    full = _greedy_text(client)
    stop = _stop_in(full)
    reply = chat(client, temperature=0, max_tokens=24, stop=["@@never@@", stop], extra_body=NO_EOS)
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.matched_stop) == ("stop", stop)
    assert choice.message.content == full[:full.index(stop)]
    streamed = chat(client, temperature=0, max_tokens=24, stop=stop, stream=True, extra_body=NO_EOS)
    text, last = "", None
    for chunk in streamed:
        text += chunk.choices[0].delta.content or ""
        last = chunk.choices[0]
    assert text == full[:full.index(stop)] and last.finish_reason == "stop"
    kept = chat(client, temperature=0, max_tokens=24, stop=stop, extra_body={**NO_EOS, "no_stop_trim": True})
    assert kept.choices[0].message.content == full[:full.index(stop) + len(stop)]
    vllm = chat(client, temperature=0, max_tokens=24, stop=stop,  # vLLM's name for it
                extra_body={**NO_EOS, "include_stop_str_in_output": True})
    assert vllm.choices[0].message.content == kept.choices[0].message.content


def test_seed_gives_the_same_sample_whatever_else_is_in_the_batch(client):
    kwargs = dict(temperature=1.0, max_tokens=16, seed=7, extra_body=NO_EOS)
    alone = chat(client, **kwargs).choices[0].message.content
    others = [threading.Thread(target=chat, args=(client,), kwargs=dict(
        temperature=1.0, max_tokens=24, messages=[{"role": "user", "content": f"noise {i}"}]))
        for i in range(6)]
    for t in others:
        t.start()
    together = chat(client, **kwargs).choices[0].message.content
    for t in others:
        t.join()
    assert together == alone
    assert chat(client, **{**kwargs, "seed": 8}).choices[0].message.content != alone


def test_n_gives_distinct_indexed_choices_and_counts_the_prompt_once(client):
    reply = chat(client, n=3, temperature=1.0, max_tokens=8, seed=1, extra_body=NO_EOS)
    single = chat(client, temperature=1.0, max_tokens=8, seed=1, extra_body=NO_EOS)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) == 3
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    assert reply.usage.completion_tokens == 24


def test_n_prefills_the_prompt_once_and_repeats_hit_the_prefix_cache(server, client):
    prompt = "A long enough prompt to fill more than one sixteen-token page of the KV cache, twice over."
    ids = server.ctx.tokenizer.encode(prompt)
    assert len(ids) > 16
    outs = httpx.post(server.base_url + "/generate", timeout=60, json={
        "text": prompt, "sampling_params": {"n": 3, "max_new_tokens": 2, "temperature": 1.0, "seed": 5}}).json()
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    whole_pages = (len(ids) - 1) // 16 * 16  # the last prompt token is always computed
    assert sorted(cached) == [0, whole_pages, whole_pages]  # one prefill, two cache hits
    messages = [{"role": "user", "content": prompt}]
    first = chat(client, messages=messages, max_tokens=2)
    again = chat(client, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_top_k_1_top_p_tiny_and_min_p_1_all_sample_the_argmax(client):
    greedy = _greedy_text(client, 12)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        reply = chat(client, temperature=1.0, max_tokens=12, seed=3, extra_body={**NO_EOS, **extra})
        assert reply.choices[0].message.content == greedy, extra
    reply = chat(client, temperature=1.0, top_p=1e-6, max_tokens=12, seed=3, extra_body=NO_EOS)
    assert reply.choices[0].message.content == greedy


def test_penalties_stop_a_biased_token_from_repeating(server, client):
    """A +4 bias makes TOKEN the argmax at every step (the tiny model's logits spread ~2.5);
    each penalty, applied to what was generated, must push it down after it has appeared."""
    bias = {str(TOKEN): 4, str(EOS): -100}

    def count(**kwargs):
        extra = {"logit_bias": bias, **kwargs.pop("extra_body", {})}
        reply = chat(client, temperature=0, max_tokens=12, extra_body=extra, **kwargs)
        ids = server.ctx.tokenizer.encode(reply.choices[0].message.content, add_special_tokens=False)
        return ids.count(TOKEN)

    assert count() == 12
    assert count(frequency_penalty=2.0) <= 3
    assert count(presence_penalty=2.0) < 12
    assert count(extra_body={"repetition_penalty": 2.0}) < 12


def test_chat_logprobs_equal_transformers_log_softmax(server, client, tiny_chat_model):
    reply = chat(client, temperature=0, max_tokens=1, logprobs=True, top_logprobs=3)
    entry = reply.choices[0].logprobs.content[0]
    prompt_ids = server.ctx.tokenizer.apply_chat_template(USER, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        logits = tiny_chat_model[1](torch.tensor([prompt_ids])).logits[0, -1]
    expected = torch.log_softmax(logits.double(), -1).numpy()
    best = np.argsort(-expected)[:3]
    assert [t.token for t in entry.top_logprobs] == [server.ctx.tokenizer.decode([int(i)]) for i in best]
    np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], expected[best], atol=1e-4)
    assert entry.token == entry.top_logprobs[0].token and entry.bytes == list(entry.token.encode())


def test_completions_logprobs_echo_and_list_prompts(server, client):
    reply = client.completions.create(model="tiny", prompt=["Hello there", "Bonjour"], max_tokens=3,
                                      temperature=0, logprobs=2, n=2, extra_body=NO_EOS)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt_index * n + sample
    assert reply.choices[0].text == reply.choices[1].text != reply.choices[2].text
    for choice in reply.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 3 and "".join(lp.tokens) == choice.text
        assert all(len(alts) == 2 for alts in lp.top_logprobs)
        assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    ids = server.ctx.tokenizer.encode("Hello there")
    assert reply.usage.prompt_tokens == len(ids) + len(server.ctx.tokenizer.encode("Bonjour"))
    echoed = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0,
                                       echo=True, extra_body=NO_EOS)
    assert echoed.choices[0].text == "Hello there" + reply.choices[0].text


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(client):
    kwargs = dict(model="tiny", prompt="Hi", max_tokens=2, logit_bias={"1": 100})  # <|im_start|>
    assert client.completions.create(**kwargs).choices[0].text == ""
    kept = client.completions.create(**kwargs, extra_body={"skip_special_tokens": False})
    assert kept.choices[0].text == "<|im_start|><|im_start|>"


def test_echo_with_logprobs_scores_the_prompt_like_transformers(server, client, tiny_chat_model):
    prompt = "The quick brown fox jumps"
    ids = server.ctx.tokenizer.encode(prompt)
    with torch.no_grad():
        logits = tiny_chat_model[1](torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits.double(), -1).numpy()
    for max_tokens in (0, 3):
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, echo=True,
                                          logprobs=2, temperature=0, extra_body=NO_EOS)
        choice, lp = reply.choices[0], reply.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and choice.text.startswith(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:len(ids)],
                                   [expected[i - 1, ids[i]] for i in range(1, len(ids))], atol=1e-4)
        best = server.ctx.tokenizer.decode([int(np.argmax(expected[0]))])
        assert max(lp.top_logprobs[1], key=lp.top_logprobs[1].get) == best
        assert reply.usage.completion_tokens == max_tokens and choice.finish_reason == "length"
    assert choice.text == prompt + client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, extra_body=NO_EOS).choices[0].text
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                       stream=True)
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].text == prompt and len(chunks[0].logprobs.tokens) == len(ids)
    assert [c.finish_reason for c in chunks] == ["length"]  # the echo is the whole answer
