"""`python -m xlaserve.launch_server` on the embedded default model, as `make serve` runs it: the
start-up log, /health, a real answer through the openai SDK, and a clean stop on SIGTERM."""
import os
import signal

import httpx
import pytest

from tests.http.conftest import launch_server_process

# Two step programs (the default-model engine test compiles the same ones), a small KV pool.
FLAGS = ["--max-running-requests", "4", "--precompile-token-paddings", "8,64",
         "--chunked-prefill-size", "24", "--max-prefill-tokens", "48", "--max-total-tokens", "1024",
         "--context-length", "512", "--enable-metrics", "--metrics-name-style", "sglang",
         "--bucket-time-to-first-token", "0.5", "50"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("launch") / "server.log"
    storage = str(log_path.parent / "storage")
    process, base_url = launch_server_process([*FLAGS, "--file-storage-path", storage], log_path)
    yield process, base_url, log_path
    if process.poll() is None:
        process.kill()


def test_startup_log_tells_what_happened_in_order(launched):
    text = launched[2].read_text()
    marks = ["server_args=ServerArgs(", "Load weight end. type=LlamaForCausalLM", "KV Cache is allocated. #tokens: 1024",
             "Precompiling", "Uvicorn running on", "The server is fired up and ready to roll!"]
    positions = [text.find(mark) for mark in marks]
    assert -1 not in positions and positions == sorted(positions), list(zip(marks, positions))


def test_startup_log_has_no_platform_probe_or_compile_cache_internals(launched):
    # JAX's INFO lines: its failed probe of every backend it knows (libtpu is installed in the
    # test environment, for the compile-only TPU tests) and the cache toggled around compiles.
    text = launched[2].read_text()
    assert "Unable to initialize backend" not in text and "Resetting cache" not in text


def test_the_default_model_answers_through_the_openai_sdk(launched):
    from openai import OpenAI

    client = OpenAI(base_url=launched[1] + "/v1", api_key="EMPTY", max_retries=0)
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    # "Name the ...": with the default q8 activations (llama.cpp's numerics) this model answers
    # "What is the capital of France?" in French nonsense, as llama-server does on its file.
    question = [{"role": "user", "content": "Name the capital of France."}]
    reply = client.chat.completions.create(model="default", messages=question, temperature=0,
                                           max_tokens=16)
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(model="default", messages=question, temperature=0,
                                            max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == reply.choices[0].message.content
    metrics = httpx.get(launched[1] + "/metrics").text  # SGLang's names, the flag's buckets
    assert "sglang:generation_tokens_total" in metrics and "xlaserve:" not in metrics
    assert 'sglang:time_to_first_token_seconds_bucket{le="50.0",model_name=' in metrics


def test_the_default_model_is_named_never_located(launched):
    from xlaserve.weights.loader import default_model_file

    # The embedded GGUF lies in the virtualenv: neither a response nor the INFO log shows where.
    folder = os.path.dirname(default_model_file())
    for route in ("/v1/models", "/get_model_info", "/get_server_info"):
        assert folder not in httpx.get(launched[1] + route).text, route
    assert folder not in launched[2].read_text()
    card = httpx.get(launched[1] + "/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == "SmolLM2-135M-Instruct"


def test_sigterm_stops_the_server_cleanly(launched):
    process = launched[0]
    process.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells it.
    assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert "Finished server process" in launched[2].read_text()
