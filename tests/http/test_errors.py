"""Bad input: every case answers its status with an OpenAI-shaped error body, and the server
answers a normal request right after."""
import httpx
import pytest

from tests.http.conftest import AppServer

OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = "word " * 600  # over the 512-token context

CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"min_tokens": 5}, "min_tokens"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options"),
    ({"regex": "[a-"}, "regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"regex": "a", "ebnf": "root ::= 'a'"}, "ebnf"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ({"max_tokens": 500}, "max_tokens"),
]


def _assert_openai_error(response: httpx.Response, status: int, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("change,param", CHAT_CASES, ids=[c[1] + str(i) for i, c in enumerate(CHAT_CASES)])
def test_bad_chat_requests_get_a_400_naming_the_parameter(server, change, param):
    response = httpx.post(server.base_url + "/v1/chat/completions", json={**OK_CHAT, **change})
    _assert_openai_error(response, 400, param)


def test_context_errors_give_both_numbers(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", json={**OK_CHAT, "max_tokens": 500})
    error = _assert_openai_error(response, 400, "max_tokens")
    assert error["code"] == "context_length_exceeded" and "512" in error["message"] and "500" in error["message"]
    response = httpx.post(server.base_url + "/v1/completions",
                          json={"model": "tiny", "prompt": LONG, "max_tokens": 1})
    error = _assert_openai_error(response, 400)
    assert "512" in error["message"] and str(len(server.ctx.tokenizer.encode(LONG))) in error["message"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 10 ** 8]}, "prompt"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ({"prompt": None}, "prompt"),
])
def test_bad_completion_requests_get_a_400(server, body, param):
    response = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", **body})
    _assert_openai_error(response, 400, param)


def test_malformed_json_and_non_object_bodies_are_400(server):
    for content in (b"{not json", b"[1, 2]", b""):
        response = httpx.post(server.base_url + "/v1/chat/completions", content=content,
                              headers={"content-type": "application/json"})
        _assert_openai_error(response, 400)


def test_unknown_model_and_route_are_404(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", json={**OK_CHAT, "model": "gpt-9"})
    assert _assert_openai_error(response, 404, "model")["code"] == "model_not_found"
    _assert_openai_error(httpx.get(server.base_url + "/v1/models/gpt-9"), 404, "model")
    _assert_openai_error(httpx.get(server.base_url + "/v1/nothing-here"), 404)


def test_the_sdk_raises_its_typed_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=OK_CHAT["messages"], temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=OK_CHAT["messages"])


@pytest.fixture(scope="module")
def guarded(server):
    """The same engine behind an app with an API key and a 4 KiB payload limit."""
    from xlaserve.http.app import create_app

    running = AppServer(create_app(server.ctx, api_key="sk-test", max_payload_size=4096), server.ctx)
    yield running
    running.close()


def test_missing_or_wrong_api_key_is_401_and_health_stays_open(guarded):
    url = guarded.base_url + "/v1/chat/completions"
    _assert_openai_error(httpx.post(url, json=OK_CHAT), 401)
    _assert_openai_error(httpx.post(url, json=OK_CHAT, headers={"Authorization": "Bearer nope"}), 401)
    assert httpx.post(url, json=OK_CHAT, headers={"Authorization": "Bearer sk-test"}).status_code == 200
    assert httpx.get(guarded.base_url + "/health").status_code == 200
    reply = guarded.openai(api_key="sk-test").chat.completions.create(
        model="tiny", messages=OK_CHAT["messages"], max_tokens=2)
    assert reply.usage.completion_tokens >= 1


def test_a_body_over_max_payload_size_is_413_announced_or_streamed(guarded):
    headers = {"Authorization": "Bearer sk-test"}
    big = {**OK_CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    response = httpx.post(guarded.base_url + "/v1/chat/completions", json=big, headers=headers)
    _assert_openai_error(response, 413)

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    response = httpx.post(guarded.base_url + "/v1/chat/completions", content=chunks(), headers=headers)
    _assert_openai_error(response, 413)


def test_the_server_still_answers_after_all_of_that(client):
    reply = client.chat.completions.create(model="tiny", messages=OK_CHAT["messages"], max_tokens=3,
                                           temperature=0, logit_bias={"2": -100})
    assert reply.usage.completion_tokens == 3
