"""The event loop stays responsive while a huge prompt is parsed, templated, tokenized and refused:
/health answers within 1 s, a stream started before keeps flowing, and the server serves after.
With that work on the loop, a 30 MB prompt blocked it for 30-40 s."""
import threading
import time

import httpx
import orjson
import pytest

from xlaserve.http import prompt_bound

HUGE = "word " * 6_000_000  # 30 MB, under the default --max-payload-size (32 MB)
LONG = "word " * 1_000_000  # 5 MB: 2-5 s of tokenizing (2-core CPU)
MAX_PAUSE_S = 1.0


class _HealthPoller(threading.Thread):
    """GETs /health back to back until stopped; `slowest` is the longest answer time."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.stopped = threading.Event()
        self.slowest = 0.0
        self.statuses: list[int] = []

    def run(self):
        with httpx.Client(timeout=120) as client:
            while not self.stopped.is_set():
                start = time.perf_counter()
                self.statuses.append(client.get(self.base_url + "/health").status_code)
                self.slowest = max(self.slowest, time.perf_counter() - start)
                time.sleep(0.02)


class _Stream(threading.Thread):
    """A 128-token chat stream (2-3 s); `gaps` are the times between its events."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.started = threading.Event()
        self.gaps: list[float] = []
        self.finish_reasons: list[str] = []

    def run(self):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell a story"}],
                "max_tokens": 128, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
            last = None
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    self.gaps.append(now - last)
                last = now
                self.started.set()
                self.finish_reasons += [c["finish_reason"] for c in orjson.loads(line[6:])["choices"]
                                        if c["finish_reason"]]


def _refused_while_serving(server, route: str, body: dict) -> dict:
    """Posts `body` while /health is polled and a stream runs; checks both kept flowing and the
    server answers after; -> the error of the refusal."""
    content = orjson.dumps(body)  # once, before the clock starts
    stream, poller = _Stream(server.base_url), _HealthPoller(server.base_url)
    stream.start()
    assert stream.started.wait(60)
    poller.start()
    response = httpx.post(server.base_url + route, content=content,
                          headers={"content-type": "application/json"}, timeout=120)
    stream.join(60)
    poller.stopped.set()
    poller.join(60)
    assert response.status_code == 400, response.text[:300]
    assert poller.statuses and set(poller.statuses) == {200}
    assert poller.slowest < MAX_PAUSE_S, poller.slowest
    assert stream.finish_reasons == ["length"] and max(stream.gaps) < MAX_PAUSE_S, max(stream.gaps)
    after = httpx.post(server.base_url + "/v1/completions",
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200
    return response.json()["error"]


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": HUGE}],
                              "max_tokens": 4}),
    ("/v1/completions", {"model": "tiny", "prompt": HUGE, "max_tokens": 4}),
    ("/generate", {"text": HUGE, "sampling_params": {"max_new_tokens": 4}}),
], ids=["chat", "completions", "generate"])
def test_a_30mb_prompt_is_refused_without_stalling_the_server(server, route, body):
    error = _refused_while_serving(server, route, body)
    assert error["code"] == "context_length_exceeded" and "512" in error["message"]


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONG}],
                              "max_tokens": 4}),
    ("/v1/completions", {"model": "tiny", "prompt": LONG, "max_tokens": 4}),
], ids=["chat", "completions"])
def test_a_long_prompt_is_tokenized_off_the_event_loop(server, monkeypatch, route, body):
    """Without the early bound (a tokenizer that gives none), the prompt is tokenized, in a
    worker thread, and refused by its token count."""
    monkeypatch.setattr(prompt_bound, "chars_per_token", lambda tokenizer: None)
    error = _refused_while_serving(server, route, body)
    assert error["code"] == "context_length_exceeded" and "characters" not in error["message"]


def test_the_bound_holds_for_the_test_tokenizer(server):
    """No text has more characters per token than the bound: the longest tokens' texts, and
    runs of the characters that merge into long tokens."""
    tokenizer = server.ctx.tokenizer
    per_token = prompt_bound.chars_per_token(tokenizer)
    assert per_token is not None
    longest = sorted(tokenizer.get_vocab().items(), key=lambda item: -len(item[0]))[:50]
    texts = ["#" * 10_000, " " * 10_000, "\n" + " " * 10_000, "=" * 10_000, "<|im_start|>" * 100,
             *(tokenizer.decode([token]) for _, token in longest)]
    for text in texts:
        assert len(tokenizer.encode(text)) * per_token >= len(text)
