"""A server with `--speculative-algorithm NGRAM` through the OpenAI SDK: the same answers as the
plain server (the session's `server`), streamed with a verified row's tokens in one event, and
SGLang's acceptance figures in `meta_info` and /metrics."""
import httpx
import pytest

from tests.http.conftest import RunningServer


@pytest.fixture(scope="module")
def spec_server(tiny_chat_model, tmp_path_factory):
    running = RunningServer(tiny_chat_model[0], served_model_name="tiny", enable_metrics=True,
                            speculative_algorithm="NGRAM",
                            file_storage_path=str(tmp_path_factory.mktemp("storage")))
    yield running
    running.close()


MESSAGES = [{"role": "user", "content": "Repeat: the cat sat on the mat, the cat sat on the mat."}]
# A large bias makes one token certain: the drafter's matches are then always right.
BIASED = {"max_tokens": 24, "temperature": 0, "logit_bias": {"1000": 100}}


def test_answers_equal_the_plain_servers_and_a_verified_rows_tokens_stream_as_one_chunk(
        server, spec_server):
    for params in (BIASED, {"max_tokens": 24, "temperature": 0},
                   {"max_tokens": 24, "temperature": 0.8, "seed": 7, "frequency_penalty": 0.5}):
        want = server.openai().chat.completions.create(model="tiny", messages=MESSAGES, **params)
        got = spec_server.openai().chat.completions.create(model="tiny", messages=MESSAGES,
                                                           **params)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens
    chunks = list(spec_server.openai().chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True, logprobs=True, **BIASED))
    tokens = [len(c.choices[0].logprobs.content) for c in chunks
              if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content]
    assert sum(tokens) == 24 and max(tokens) > 1, tokens
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == got_text(spec_server)


def got_text(running) -> str:
    reply = running.openai().chat.completions.create(model="tiny", messages=MESSAGES, **BIASED)
    return reply.choices[0].message.content


def test_meta_info_and_metrics_report_the_accept_length(spec_server):
    body = {"text": "a b a b a b", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                       "logit_bias": {"1000": 100}}}
    meta = httpx.post(spec_server.base_url + "/generate", json=body, timeout=60).json()["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1
    metrics = httpx.get(spec_server.base_url + "/metrics", timeout=10).text
    line = next(l for l in metrics.splitlines() if l.startswith("xlaserve:spec_accept_length"))
    assert float(line.split()[-1]) > 1
