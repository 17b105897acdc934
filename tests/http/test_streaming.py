"""SSE streaming for chat and completions: chunk layout, usage, logprobs, n > 1, equality with
the non-streamed answer, and a client that disconnects freeing its slot at once."""
import time

import httpx
import orjson

NO_EOS = {"logit_bias": {"2": -100}}
USER = [{"role": "user", "content": "Write a haiku about rain"}]


def _events(base_url: str, route: str, body: dict) -> list:
    with httpx.stream("POST", base_url + route, json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [orjson.loads(line[6:]) for line in lines[:-1]]


def test_chat_stream_layout_usage_and_text_equal_the_plain_answer(server, client):
    body = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 0, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}, **NO_EOS}
    events = _events(server.base_url, "/v1/chat/completions", body)
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0,
                                           n=2, extra_body=NO_EOS)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"] == plain.usage.model_dump(exclude_none=True) | {
        "prompt_tokens_details": {"cached_tokens": usage["usage"]["prompt_tokens_details"]["cached_tokens"]}}
    assert all(c["usage"] is None for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"
        text = "".join(m["delta"].get("content") or "" for m in mine)
        assert text == plain.choices[index].message.content


def test_chat_stream_with_logprobs_has_one_entry_per_token(client):
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0,
                                            stream=True, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    entries = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
               for e in chunk.choices[0].logprobs.content]
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)


def test_completion_stream_equals_the_plain_answer_with_echo(server, client):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
            "echo": True, "stream": True, **NO_EOS}
    events = _events(server.base_url, "/v1/completions", body)
    text = "".join(e["choices"][0]["text"] for e in events)
    plain = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                      temperature=0, echo=True, extra_body=NO_EOS)
    assert text == plain.choices[0].text and text.startswith("Once upon a time")
    assert [e["choices"][0]["finish_reason"] for e in events].count("length") == 1
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)


def test_continuous_usage_stats_count_tokens_as_they_come(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **NO_EOS}
    events = _events(server.base_url, "/v1/chat/completions", body)
    counts = [e["usage"]["completion_tokens"] for e in events[1:-1]]
    assert counts == sorted(counts) and counts[-1] == 4


def test_stream_interval_batches_tokens_per_chunk(server):
    server.ctx.stream_interval = 3
    try:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 9, "temperature": 0, "stream": True,
                "logprobs": 0, **NO_EOS}
        events = _events(server.base_url, "/v1/completions", body)
    finally:
        server.ctx.stream_interval = 1
    sizes = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"][0]["logprobs"]]
    assert sizes == [3, 3, 3]


def _wait_idle(server, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.ctx.engine.core.stats()["num_running_reqs"] == 0:
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_disconnects_frees_its_slot(server):
    assert _wait_idle(server)
    body = {"model": "tiny", "messages": USER, "max_tokens": 400, "temperature": 0, "stream": True, **NO_EOS}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.ctx.engine.core.stats()["num_running_reqs"] == 1
    assert _wait_idle(server, 5.0), "the stream's request kept running after the client left"
    # A non-streamed request whose client times out is aborted too.
    body["stream"] = False
    try:
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=0.5)
    except httpx.TimeoutException:
        pass
    assert _wait_idle(server, 5.0), "the request kept running after its client timed out"
