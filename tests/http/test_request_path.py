"""The path of one plain streaming chat request, traced (issue 49: a request in few hops).

Every Python call in the server's threads (uvicorn's, the engine loop's, the output thread's,
the worker threads) is seen by a profile function while one request runs: which files under
xlaserve/ run code for it, and which values cross from one stage's folder to another's (a call's
arguments and return value; http, runtime/engine, runtime/scheduler, runtime/executor,
runtime/sampling, model, ...). The bounds are the house's: a newcomer follows a plain request
through at most MAX_FILES files and MAX_TYPES named types (docs/architecture.md lists both), and
no bare tuple or dict carries one of our objects from one stage to another (a NamedTuple or a
dataclass says what each field is).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import RunningServer

import xlaserve

PACKAGE = str(Path(xlaserve.__file__).resolve().parent) + "/"
MAX_FILES = 22  # 20 before the prefix cache's split into free list, tree and reuse (issue 56)
MAX_TYPES = 12
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "stream": True,
        "max_tokens": 8}


def _stage(filename: str) -> str:
    parts = filename[len(PACKAGE):].split("/")
    return "/".join(parts[:2]) if parts[0] == "runtime" else parts[0]


def _ours(value) -> bool:
    return type(value).__module__.startswith("xlaserve")


class PathTrace:
    """Files run and values passed between stages while `recording` is set."""

    def __init__(self):
        self.recording = False
        self.files: set[str] = set()
        self.crossing_types: dict[str, str] = {}  # type name -> one call it crossed in
        self.bare_containers: list[str] = []

    def profile(self, frame, event, arg):
        if not self.recording:
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return
        if event == "call":
            self.files.add(code.co_filename[len(PACKAGE):])
        caller = frame.f_back
        if caller is None or not caller.f_code.co_filename.startswith(PACKAGE):
            return
        here, there = _stage(caller.f_code.co_filename), _stage(code.co_filename)
        if here == there:
            return
        if event == "call":
            for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
                if name not in ("self", "cls"):
                    self._crossed(frame.f_locals.get(name), f"{here} -> {there}: "
                                  f"{code.co_name}({name})")
        elif event == "return" and arg is not None:
            self._crossed(arg, f"{there} -> {here}: {code.co_name} returns")

    def _crossed(self, value, where: str) -> None:
        if _ours(value):
            self.crossing_types.setdefault(type(value).__qualname__, where)
            return
        if type(value) in (tuple, dict, list):
            items = list(value.values() if isinstance(value, dict) else value)[:8]
            for item in items:
                if _ours(item):
                    self.crossing_types.setdefault(type(item).__qualname__, where)
                    if type(value) is not list:  # a list of one named type is fine
                        self.bare_containers.append(f"a bare {type(value).__name__} of "
                                                    f"{type(item).__qualname__}: {where}")


@pytest.fixture(scope="module")
def traced(tiny_chat_model):
    trace = PathTrace()
    # Threads started from here on (the server's) carry the profile function; it returns at once
    # until the traced request starts.
    threading.setprofile(trace.profile)
    try:
        server = RunningServer(tiny_chat_model[0], served_model_name="tiny")
    finally:
        threading.setprofile(None)
    try:
        with httpx.Client(timeout=60) as client:
            client.post(server.base_url + "/v1/chat/completions", json=BODY).read()  # warm
            time.sleep(0.3)  # the warm-up's last outputs are handed out
            trace.recording = True
            response = client.post(server.base_url + "/v1/chat/completions", json=BODY)
            time.sleep(0.3)
            trace.recording = False
        assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    finally:
        server.close()
    return trace


def test_a_plain_streaming_chat_request_runs_code_in_at_most_22_files(traced):
    files = sorted(traced.files)
    assert len(files) <= MAX_FILES, f"{len(files)} files: {files}"


def test_at_most_12_named_types_cross_between_stages_and_no_bare_tuple_or_dict(traced):
    types = traced.crossing_types
    assert len(types) <= MAX_TYPES, "\n".join(f"{t}: {where}" for t, where in sorted(types.items()))
    assert not traced.bare_containers, traced.bare_containers
