"""LoRA adapters through the server (issue 53): every route picks an adapter by lora_path or
model BASE:NAME / NAME and answers with transformers + peft's tokens; /v1/models lists them;
SGLang's and vLLM's load and unload routes work while serving; a name that is not loaded is a
4xx naming it, never the base model's answer. Two slots and --max-loaded-loras 3 (issue 73): a
third adapter loads into host memory and its requests wait for a slot."""
import json
import time

import httpx
import pytest

from tests.hf_reference import hf_greedy
from tests.http.conftest import RunningServer
from tests.http.test_batches import results, upload, wait
from tests.lora.peft_adapters import make_adapter

IDS = [785, 6722, 314, 5483, 314, 260, 1180, 28, 9]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def adapters(tiny_chat_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    specs = {"sql": dict(r=4, targets=["q_proj", "v_proj", "down_proj"], alpha=8, seed=5),
             "poem": dict(r=8, targets=["k_proj", "o_proj", "up_proj"], alpha=8, seed=6),
             "chat": dict(r=2, targets=["q_proj", "gate_proj"], alpha=4, seed=7)}
    merged = {n: make_adapter(tiny_chat_model[0], str(root / n), **kw) for n, kw in specs.items()}
    return {n: str(root / n) for n in specs}, merged


@pytest.fixture(scope="module")
def lora_server(tiny_chat_model, adapters, tmp_path_factory):
    paths, _ = adapters
    running = RunningServer(tiny_chat_model[0], served_model_name="tiny",
                            lora_paths=[f"sql={paths['sql']}"], max_loras_per_batch=2,
                            max_loaded_loras=3,
                            max_lora_rank=8, lora_target_modules=["all"],
                            file_storage_path=str(tmp_path_factory.mktemp("storage")))
    yield running
    running.close()


def _generate(server, **body):
    return httpx.post(server.base_url + "/generate", json=body, timeout=60)


def test_generate_rows_of_base_and_adapter_in_one_call_equal_transformers_with_peft(
        lora_server, tiny_chat_model, adapters):
    out = _generate(lora_server, input_ids=[IDS, IDS, IDS[:5]], sampling_params=GREEDY,
                    lora_path=[None, "sql", "sql"]).json()
    _, merged = adapters
    assert out[0]["output_ids"] == hf_greedy(tiny_chat_model[1], IDS, 8)
    assert out[1]["output_ids"] == hf_greedy(merged["sql"], IDS, 8) != out[0]["output_ids"]
    assert out[2]["output_ids"] == hf_greedy(merged["sql"], IDS[:5], 8)


def test_every_openai_route_takes_the_adapter_by_model_or_lora_path(lora_server):
    client = lora_server.openai()
    expected = _generate(lora_server, input_ids=IDS, sampling_params=GREEDY,
                         lora_path="sql").json()["text"]
    base = _generate(lora_server, input_ids=IDS, sampling_params=GREEDY).json()["text"]
    assert expected != base
    for kwargs in ({"model": "tiny:sql"}, {"model": "sql"},
                   {"model": "tiny", "extra_body": {"lora_path": "sql"}}):
        out = client.completions.create(prompt=IDS, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, **kwargs.pop(
                                            "extra_body", {})}, **kwargs)
        assert out.choices[0].text == expected, kwargs
    chats = [client.chat.completions.create(messages=CHAT, max_tokens=8, temperature=0, **kw)
             .choices[0].message.content
             for kw in ({"model": "tiny:sql"}, {"model": "tiny", "extra_body": {"lora_path": "sql"}},
                        {"model": "tiny"})]
    assert chats[0] == chats[1] != chats[2]
    response = client.responses.create(model="tiny:sql", input=CHAT[0]["content"],
                                       max_output_tokens=8, temperature=0)
    assert response.output_text == chats[0]
    response = client.responses.create(model="tiny", input=CHAT[0]["content"], max_output_tokens=8,
                                       temperature=0, extra_body={"lora_path": "sql"})
    assert response.output_text == chats[0]


def test_a_batch_line_runs_with_its_adapter(lora_server, tmp_path):
    client = lora_server.openai()
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny:sql", "messages": CHAT, "max_tokens": 8, "temperature": 0}}
    base = {**line, "custom_id": "b", "body": {**line["body"], "model": "tiny"}}
    batch = client.batches.create(input_file_id=upload(client, tmp_path, [line, base]).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait(client, batch)
    by_id = results(client, batch.output_file_id)
    chat = client.chat.completions.create(model="tiny:sql", messages=CHAT, max_tokens=8,
                                          temperature=0).choices[0].message.content
    content = by_id["a"]["response"]["body"]["choices"][0]["message"]["content"]
    assert content == chat != by_id["b"]["response"]["body"]["choices"][0]["message"]["content"]


def test_models_lists_the_adapters_with_their_parent(lora_server):
    data = httpx.get(lora_server.base_url + "/v1/models").json()["data"]
    cards = {card["id"]: card for card in data}
    assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == "sql"
    assert "parent" not in cards["tiny"]
    assert httpx.get(lora_server.base_url + "/v1/models/tiny:sql").json()["id"] == "sql"


def test_names_not_loaded_are_refused_naming_them(lora_server):
    client = lora_server.openai()
    import openai

    with pytest.raises(openai.NotFoundError, match="tiny:nope"):
        client.chat.completions.create(model="tiny:nope", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'nope' is not loaded") as error:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                       extra_body={"lora_path": "nope"})
    assert error.value.body["param"] == "lora_path"
    out = _generate(lora_server, input_ids=[IDS, IDS], sampling_params=GREEDY,
                    lora_path=["sql", "nope"])
    assert out.status_code == 400 and "'nope' is not loaded" in out.json()["error"]["message"]
    out = _generate(lora_server, input_ids=IDS, sampling_params=GREEDY, lora_path=["sql", None])
    assert out.status_code == 400 and out.json()["error"]["param"] == "lora_path"
    with pytest.raises(openai.BadRequestError, match="give one"):
        client.chat.completions.create(model="tiny:sql", messages=CHAT, max_tokens=2,
                                       extra_body={"lora_path": "poem"})


def test_load_and_unload_while_serving_with_sglang_and_vllm_routes(lora_server, adapters,
                                                                   tiny_chat_model):
    paths, merged = adapters
    url = lora_server.base_url
    compiled = lora_server.ctx.core.runner.compile_count()
    out = httpx.post(url + "/load_lora_adapter",
                     json={"lora_name": "poem", "lora_path": paths["poem"]}, timeout=60).json()
    assert out["success"] and set(out["loaded_adapters"]) == {"sql", "poem"}
    got = _generate(lora_server, input_ids=IDS, sampling_params=GREEDY, lora_path="poem").json()
    assert got["output_ids"] == hf_greedy(merged["poem"], IDS, 8)
    # both slots hold one: a third is kept in host memory, and listed
    third = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "chat", "lora_path": paths["chat"]}, timeout=60)
    assert third.status_code == 200 and "added" in third.text
    listed = {c["id"] for c in httpx.get(url + "/v1/models").json()["data"]}
    assert {"sql", "poem", "chat"} <= listed
    full = httpx.post(url + "/load_lora_adapter",
                      json={"lora_name": "more", "lora_path": paths["poem"]}, timeout=60)
    assert full.status_code == 400
    assert "--max-loaded-loras 3" in full.json()["error"]["message"]
    # three adapters in one call on two slots: one waits for a slot, none fails
    rows = ["chat", "sql", "poem", None]
    got = _generate(lora_server, input_ids=[IDS] * 4, sampling_params=GREEDY, lora_path=rows)
    assert got.status_code == 200
    for adapter, out in zip(rows, got.json(), strict=True):
        oracle = tiny_chat_model[1] if adapter is None else merged[adapter]
        assert out["output_ids"] == hf_greedy(oracle, IDS, 8), adapter
    assert lora_server.ctx.core.features.lora.slots.swaps >= 2
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "chat"},
                      timeout=60).status_code == 200
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "poem"}, timeout=60)
    assert gone.status_code == 200 and "removed" in gone.text
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "poem"},
                      timeout=60).status_code == 404
    bad = httpx.post(url + "/v1/load_lora_adapter",
                     json={"lora_name": "x", "lora_path": "/nonexistent/adapter"}, timeout=60)
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    refused = _generate(lora_server, input_ids=IDS, sampling_params=GREEDY, lora_path="poem")
    assert refused.status_code == 400
    assert "poem" not in {c["id"] for c in httpx.get(url + "/v1/models").json()["data"]}
    assert lora_server.ctx.core.runner.compile_count() == compiled


def test_unload_waits_for_the_adapters_running_requests(lora_server, adapters):
    paths, _ = adapters
    url = lora_server.base_url
    assert httpx.post(url + "/load_lora_adapter", json={"lora_name": "long",
                      "lora_path": paths["poem"]}, timeout=60).status_code == 200
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", url + "/generate", json={
                "input_ids": IDS, "lora_path": "long", "stream": True,
                "sampling_params": {"max_new_tokens": 200, "temperature": 0,
                                    "ignore_eos": True}}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # running
            started = time.monotonic()
            unloaded = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "long"},
                                  timeout=120)
            rest = [line for line in lines if line.startswith("data:")]
    assert unloaded.status_code == 200 and time.monotonic() > started
    last = json.loads(rest[-2][len("data:"):])  # the final chunk before [DONE]
    assert last["meta_info"]["completion_tokens"] == 200  # it ran to its end, unaborted
