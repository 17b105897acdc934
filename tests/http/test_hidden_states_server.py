"""SGLang's return_hidden_states on /generate (--enable-return-hidden-states): `meta_info`'s
`hidden_states`, an entry per output token (the prompt's rows with the first, then the row of
the token before each later one), equal to transformers' last hidden states; a stream's every
event holds the rows so far, as SGLang's; a request over --max-hidden-state-values, or to a
server without the flag, is a 400 before anything runs; no compile while serving."""
import httpx
import numpy as np
import orjson
import pytest
import torch

from tests.http.conftest import RunningServer

GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hidden_server(tiny_chat_model):
    # 64 wide: (prompt + max_new_tokens - 1) x 64 values per sequence, at most 40 rows' worth.
    running = RunningServer(tiny_chat_model[0], enable_return_hidden_states=True,
                            max_hidden_state_values=40 * 64)
    yield running
    running.close()


def transformers_rows(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()


def rows_of(entries: list) -> np.ndarray:
    return np.concatenate([np.asarray(entries[0], np.float32)]
                          + [np.asarray(e, np.float32)[None] for e in entries[1:]])


def test_generate_returns_hidden_states_equal_to_transformers(hidden_server, tiny_chat_model):
    compiled = hidden_server.ctx.core.runner.compile_count()
    body = {"text": ["The capital of France is", "Hi"], "return_hidden_states": True,
            "sampling_params": GREEDY}
    outs = httpx.post(hidden_server.base_url + "/generate", json=body, timeout=60).json()
    for text, out in zip(body["text"], outs):
        prompt = hidden_server.ctx.tokenizer.encode(text)
        entries = out["meta_info"]["hidden_states"]
        assert len(entries) == 5 and np.shape(entries[0]) == (len(prompt), 64)
        np.testing.assert_allclose(
            rows_of(entries), transformers_rows(tiny_chat_model[1], prompt + out["output_ids"][:-1]),
            rtol=1e-4, atol=1e-4)
    plain = httpx.post(hidden_server.base_url + "/generate", timeout=60,
                       json={"text": "Hi", "sampling_params": GREEDY}).json()
    assert "hidden_states" not in plain["meta_info"] and plain["output_ids"] == outs[1]["output_ids"]
    assert hidden_server.ctx.core.runner.compile_count() == compiled


def test_each_streamed_event_holds_the_hidden_states_so_far(hidden_server):
    body = {"input_ids": [5, 6, 7, 8], "return_hidden_states": True, "sampling_params": GREEDY}
    whole = httpx.post(hidden_server.base_url + "/generate", json=body, timeout=60).json()
    with httpx.stream("POST", hidden_server.base_url + "/generate", json={**body, "stream": True},
                      timeout=60) as response:
        events = [orjson.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert [len(e["meta_info"]["hidden_states"]) for e in events] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(rows_of(events[-1]["meta_info"]["hidden_states"]),
                               rows_of(whole["meta_info"]["hidden_states"]), atol=1e-5)


@pytest.mark.parametrize("body", [
    # 30 + 10 - 1 rows, twice (n=2): 78 > 40
    {"input_ids": list(range(5, 35)), "sampling_params": {"max_new_tokens": 10, "n": 2}},
    # a stream of 8 events over a 4-token prompt: 8 x 4 + 28 = 60 rows > 40
    {"input_ids": [5, 6, 7, 8], "stream": True, "sampling_params": {"max_new_tokens": 8}},
], ids=["two sequences", "a stream"])
def test_more_hidden_states_than_the_bound_is_a_400(hidden_server, body):
    response = httpx.post(hidden_server.base_url + "/generate", timeout=60,
                          json={**body, "return_hidden_states": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "return_hidden_states"
    assert "--max-hidden-state-values" in error["message"]


def test_a_server_without_the_flag_refuses_in_sglangs_words(server):
    response = httpx.post(server.base_url + "/generate", timeout=60,
                          json={"input_ids": [5, 6], "return_hidden_states": True})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "The server is not configured to return the hidden states. Please set "
        "`--enable-return-hidden-states` to enable this feature.")
