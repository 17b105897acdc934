"""A real server for the HTTP tests: uvicorn on a free port, in a thread of the test process.

The model is a tiny random Qwen2 with the default model's vocabulary, saved with the default
model's tokenizer (and its ChatML template), so the whole text path runs (chat template, byte-level
BPE, multi-byte characters, <|im_end|>) at a tiny model's speed. Outputs are gibberish, but
deterministic, which is all the tests need; transformers runs the same checkpoint as the oracle.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from tests.tiny_models import make_tiny_checkpoint

VOCAB = 49152
SERVER_DEFAULTS = dict(dtype="float32", page_size=16, max_running_requests=16, context_length=512,
                       chunked_prefill_size=64, max_prefill_tokens=128, max_total_tokens=8192,
                       random_seed=0)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    from xlaserve.weights.formats import gguf_file
    from xlaserve.weights.loader import default_model_file

    directory = str(tmp_path_factory.mktemp("tiny-chat-qwen2"))
    hf_model = make_tiny_checkpoint(directory, "qwen2", vocab_size=VOCAB)
    gguf_file.load_tokenizer(default_model_file()).save_pretrained(directory)
    return directory, hf_model


class AppServer:
    """uvicorn serving `app` on a free port from a thread of this process."""

    def __init__(self, app, ctx):
        import uvicorn

        self.app, self.ctx = app, ctx
        self.port = _free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the server did not become ready")

    def openai(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=kwargs.pop("api_key", "EMPTY"),
                      max_retries=0, **kwargs)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class RunningServer(AppServer):
    """The whole server (engine, app, warm-up) as `launch_server` builds it."""

    def __init__(self, model_path: str | None, **overrides):
        from xlaserve.launch_server import build_app, make_context
        from xlaserve.server_args import ServerArgs

        # Files and batches in a folder of their own, never the default one, removed at close
        # (26 were left in /tmp by each `make test`).
        self._storage = None
        if "file_storage_path" not in overrides:
            self._storage = overrides["file_storage_path"] = tempfile.mkdtemp(
                prefix="xlaserve-storage-")
        self.args = ServerArgs(model_path=model_path, **{**SERVER_DEFAULTS, **overrides})
        ctx = make_context(self.args)
        super().__init__(build_app(self.args, ctx), ctx)

    def close(self) -> None:
        super().close()
        if self._storage is not None:
            shutil.rmtree(self._storage, ignore_errors=True)


def tiny_family_server(tmp_path_factory, family: str, **overrides):
    """(a RunningServer, transformers' model) of a tiny random `family` (tests/tiny_models.py)
    with the default model's tokenizer and chat template; `overrides`: ServerArgs fields."""
    from tests.tiny_models import make_tiny_checkpoint
    from xlaserve.weights.formats import gguf_file
    from xlaserve.weights.loader import default_model_file

    directory = str(tmp_path_factory.mktemp(f"tiny-chat-{family}"))
    hf_model = make_tiny_checkpoint(directory, family, vocab_size=VOCAB)
    gguf_file.load_tokenizer(default_model_file()).save_pretrained(directory)
    return RunningServer(directory, **overrides), hf_model


def greedy_chat(server, hf_model, messages, new_tokens: int) -> tuple[list[int], str]:
    """(the chat template's prompt ids, transformers' greedy continuation as text) of
    `messages` on `server`'s tokenizer and `hf_model`."""
    from tests.hf_reference import hf_greedy

    prompt_ids = server.ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          return_dict=False)
    return prompt_ids, server.ctx.tokenizer.decode(hf_greedy(hf_model, prompt_ids, new_tokens),
                                                   skip_special_tokens=True)


def check_chat_and_stream(server, hf_model, model: str, messages, new_tokens: int = 16):
    """A greedy chat answer of `new_tokens`, plain and streamed, is transformers' (the parsers
    find no <think> or <tool_call> in random text: it is all content); returns its prompt ids
    and text."""
    client = server.openai()
    prompt_ids, expected = greedy_chat(server, hf_model, messages, new_tokens)
    response = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                              max_tokens=new_tokens)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == new_tokens
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.content == expected
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                            max_tokens=new_tokens, stream=True)
    pieces = [chunk.choices[0].delta.content for chunk in stream
              if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(pieces) == expected
    return prompt_ids, expected


def launch_server_process(flags: list[str], log_path, timeout: float = 600):
    """`python -m xlaserve.launch_server` in a subprocess on a free port, its output appended
    to `log_path`; -> (process, base URL) once /health answers 200 (the test fails otherwise)."""
    port = _free_port()
    with open(log_path, "a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "xlaserve.launch_server", "--port", str(port), *flags],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail("the server did not become ready:\n" + open(log_path).read()[-3000:])


def _free_port() -> int:
    """A port free now and below the kernel's ephemeral range: a port the kernel hands out (bind
    to 0) can be handed out again as some other connection's local port before the server binds
    it (a CI run lost a multi-host test so: Gloo's connections took the leader's HTTP port)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    for _ in range(200) if ephemeral_low > 12000 else ():
        port = random.SystemRandom().randrange(10000, ephemeral_low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tiny_chat_model, tmp_path_factory):
    running = RunningServer(tiny_chat_model[0], served_model_name="tiny", enable_metrics=True,
                            file_storage_path=str(tmp_path_factory.mktemp("storage")))
    yield running
    running.close()


@pytest.fixture(scope="session")
def client(server):
    return server.openai()
