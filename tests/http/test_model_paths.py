"""No path on the server's disk in a response (issue 48): the model is served and described by its
directory's name (/v1/models, /get_model_info), /get_server_info shows each path flag by its last
component, and clients that send the --model-path they launched with (vLLM's and SGLang's habit)
are still served. One server of its own: the session server sets --served-model-name."""
import dataclasses
import os
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import RunningServer
from xlaserve.server_args import ServerArgs, public_name

TEMPLATE = str(Path(__file__).parent / "templates" / "qwen2.5-instruct.jinja")


@pytest.fixture(scope="module")
def by_path(tiny_chat_model, tmp_path_factory):
    """Every path flag a server takes given as an absolute path, no --served-model-name."""
    directory = tiny_chat_model[0]
    assert os.path.isabs(directory)
    running = RunningServer(directory, tokenizer_path=directory, chat_template=TEMPLATE,
                            conversion_cache_dir=str(tmp_path_factory.mktemp("converted")),
                            file_storage_path=str(tmp_path_factory.mktemp("storage")))
    yield running
    running.close()


def _strings(value):
    """Every string in a JSON value, keys included."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str):
        yield value


def test_no_response_shows_a_path_on_the_servers_disk(by_path):
    name = os.path.basename(by_path.args.model_path)
    routes = ["/v1/models", f"/v1/models/{name}", "/get_model_info", "/get_server_info"]
    for route in routes:
        response = httpx.get(by_path.base_url + route)
        assert response.status_code == 200, (route, response.text)
        # The folders above the model (pytest's tmp root) appear nowhere, nor any absolute path.
        assert os.path.dirname(by_path.args.model_path) not in response.text, route
        absolute = [s for s in _strings(response.json()) if os.path.isabs(s)]
        assert absolute == [], (route, absolute)


def test_the_model_is_served_and_described_by_its_directory_name(by_path):
    name = os.path.basename(by_path.args.model_path)
    card = httpx.get(by_path.base_url + "/v1/models").json()["data"][0]
    assert card["id"] == name and card["root"] == name
    info = httpx.get(by_path.base_url + "/get_model_info").json()
    assert info["served_model_name"] == name
    assert info["model_path"] == name and info["tokenizer_path"] == name
    server_info = httpx.get(by_path.base_url + "/get_server_info").json()
    assert server_info["model_path"] == name and server_info["tokenizer_path"] == name
    assert server_info["chat_template"] == "qwen2.5-instruct.jinja"
    assert server_info["file_storage_path"] == os.path.basename(by_path.args.file_storage_path)


def test_a_client_may_still_name_the_model_by_the_path_it_was_launched_with(by_path):
    client = by_path.openai()
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    for model in (by_path.args.model_path, os.path.basename(by_path.args.model_path), "default"):
        reply = client.chat.completions.create(model=model, **chat)
        assert reply.model == os.path.basename(by_path.args.model_path)  # the served name
    # /v1/models/{id} takes the same aliases and answers with the served model's card.
    card = httpx.get(by_path.base_url + "/v1/models/" + by_path.args.model_path).json()
    assert card["id"] == os.path.basename(by_path.args.model_path)
    unknown = httpx.post(by_path.base_url + "/v1/chat/completions",
                         json={"model": "gpt-9", **chat})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert httpx.get(by_path.base_url + "/v1/models/gpt-9").status_code == 404


def test_public_name_keeps_a_name_and_shortens_a_path(tmp_path, monkeypatch):
    assert public_name(None) is None
    assert public_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # a hub id
    assert public_name("chatml") == "chatml"  # a built-in template
    jinja = "{% for m in messages %}{{ m.content }} / {% endfor %}"
    assert public_name(jinja) == jinja
    model = tmp_path / "models" / "qwen"
    model.mkdir(parents=True)
    assert public_name(str(model)) == public_name(str(model) + "/") == "qwen"
    assert public_name(str(model / "model.gguf")) == "model.gguf"  # absolute, even if absent
    monkeypatch.chdir(tmp_path)
    assert public_name("models/qwen/") == public_name("./models/qwen") == "qwen"  # relative
    assert public_name("models/absent") == "models/absent"  # no such file: kept, as a hub id
    monkeypatch.chdir(model)
    assert public_name(".") == "qwen"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert public_name("~/models/qwen") == "qwen"


def test_get_server_info_shows_every_path_flag_by_its_name():
    flags = {f.name for f in dataclasses.fields(ServerArgs) if f.metadata.get("path")}
    # A new flag named like a path must be marked too (or this list says why not).
    named_like_paths = {f.name for f in dataclasses.fields(ServerArgs)
                        if f.name.endswith(("_path", "_dir"))}
    assert named_like_paths | {"chat_template"} == flags
    args = ServerArgs(**{flag: f"/srv/secret/{flag}" for flag in flags}, api_key="sk-x")
    served = args.served()
    assert {flag: getattr(served, flag) for flag in flags} == {flag: flag for flag in flags}
    assert served.api_key == "***" and args.redacted().model_path == "/srv/secret/model_path"
