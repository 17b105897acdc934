"""An RL trainer's routes through the server (issue 75), as it calls SGLang's: weights from disk
and from base64 safetensors bytes serve transformers' tokens on the new weights, with the new
weight_version in meta_info and /get_model_info; pickles, unknown paths and process groups are
refused with SGLang's `success: false` and a 400; memory released and resumed, generation paused
and continued, vLLM's sleep mode over the same calls."""
import base64
import pickle
import threading

import httpx
import pytest
from safetensors.torch import save

from tests.hf_reference import hf_greedy
from tests.http.conftest import VOCAB, RunningServer
from tests.tiny_models import make_tiny_checkpoint

IDS = [785, 6722, 314, 5483, 314, 260, 1180, 28, 9]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def second_model(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-chat-qwen2-step"))
    return directory, make_tiny_checkpoint(directory, "qwen2", vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def rl_server(tiny_chat_model):
    # Safetensors bytes of the whole model in one body: 40 MB of base64 (vocabulary 49152).
    running = RunningServer(tiny_chat_model[0], served_model_name="tiny",
                            max_payload_size=128 << 20)
    yield running
    running.close()


def _post(server, route, body=None, **kwargs):
    return httpx.post(server.base_url + route, json=body, timeout=120, **kwargs)


def _greedy(server) -> dict:
    return _post(server, "/generate", {"input_ids": IDS, "sampling_params": GREEDY}).json()


def test_weights_from_disk_then_from_safetensors_bytes(rl_server, tiny_chat_model, second_model):
    first, hf_first = tiny_chat_model
    second, hf_second = second_model
    assert _greedy(rl_server)["output_ids"] == hf_greedy(hf_first, IDS, 8)
    answer = _post(rl_server, "/update_weights_from_disk",
                   {"model_path": second, "weight_version": "step-7"})
    assert answer.status_code == 200 and answer.json()["success"] is True
    assert answer.json()["num_paused_requests"] == 0
    out = _greedy(rl_server)
    assert out["output_ids"] == hf_greedy(hf_second, IDS, 8)
    assert out["meta_info"]["weight_version"] == "step-7"
    assert httpx.get(rl_server.base_url + "/get_model_info").json()["weight_version"] == "step-7"
    assert httpx.get(rl_server.base_url + "/get_weight_version").json() == {
        "weight_version": "step-7"}
    tensors = {n: t.contiguous() for n, t in hf_first.state_dict().items()
               if n != "lm_head.weight" or not hf_first.config.tie_word_embeddings}
    names = sorted(tensors)
    for bucket in (names[:len(names) // 2], names[len(names) // 2:]):  # two calls, as verl's
        entry = base64.b64encode(save({n: tensors[n] for n in bucket})).decode()
        answer = _post(rl_server, "/update_weights_from_tensor",
                       {"serialized_named_tensors": [entry], "weight_version": "step-8"})
        assert answer.status_code == 200 and answer.json()["success"], answer.text
        if bucket[0] == names[0]:  # the first half held: still the second model's weights
            assert "held" in answer.json()["message"]
            assert _greedy(rl_server)["output_ids"] == hf_greedy(hf_second, IDS, 8)
    assert _greedy(rl_server)["output_ids"] == hf_greedy(hf_first, IDS, 8)


def test_refusals_are_sglang_failures_with_a_reason(rl_server):
    pickled = base64.b64encode(pickle.dumps({"a": 1})).decode()
    cases = [("/update_weights_from_disk", {"model_path": "/no/such/checkpoint"},
              "not a file or directory"),
             ("/update_weights_from_tensor", {"serialized_named_tensors": [pickled]},
              "pickled tensors run code"),
             ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]},
              "not base64"),
             ("/init_weights_update_group", {"master_address": "x", "master_port": 1,
                                             "rank_offset": 1, "world_size": 2},
              "not built")]
    for route, body, reason in cases:
        answer = _post(rl_server, route, body)
        assert answer.status_code == 400 and answer.json()["success"] is False, route
        assert reason in answer.json()["message"], answer.json()
    answer = _post(rl_server, "/get_weights_by_name", {"name": "model.no_such.weight"})
    assert answer.status_code == 400 and "e.g." in answer.json()["error"]["message"]
    example = answer.json()["error"]["message"].split("e.g. ")[1].strip("')")
    rows = _post(rl_server, "/get_weights_by_name", {"name": example, "truncate_size": 3})
    assert rows.status_code == 200 and len(rows.json()) <= 3
    if example == "embedding":  # [49152, 64]: 4096 rows are 262144 values, under the bound
        many = _post(rl_server, "/get_weights_by_name", {"name": example, "truncate_size": 4096})
        assert many.status_code == 200 and len(many.json()) == 4096
    answer = _post(rl_server, "/pause_generation", {"mode": "sideways"})
    assert answer.status_code == 400


def test_memory_release_pause_and_vllm_sleep_mode(rl_server, tiny_chat_model):
    expected = _greedy(rl_server)["output_ids"]
    assert _post(rl_server, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    result = {}
    thread = threading.Thread(target=lambda: result.update(_greedy(rl_server)))
    thread.start()
    thread.join(0.5)
    assert not result  # paused: queued, not run
    assert _post(rl_server, "/continue_generation").status_code == 200
    thread.join()
    assert result["output_ids"] == expected
    assert _post(rl_server, "/sleep", params={"level": 1}).status_code == 200
    assert httpx.get(rl_server.base_url + "/is_sleeping").json() == {"is_sleeping": True}
    assert _post(rl_server, "/wake_up").status_code == 200
    assert httpx.get(rl_server.base_url + "/is_sleeping").json() == {"is_sleeping": False}
    assert _greedy(rl_server)["output_ids"] == expected  # level 1 kept the weights
    assert _post(rl_server, "/release_memory_occupation", {"tags": ["kv_cache"]}).json()[
        "success"]
    assert _post(rl_server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).json()[
        "success"]
    assert _greedy(rl_server)["output_ids"] == expected
