"""SGLang's native routes (/generate, health, model and server info, flush_cache) and /metrics."""
import os

import httpx
import orjson

from tests.hf_reference import hf_greedy


def test_generate_returns_text_ids_and_meta_info_equal_to_transformers(server, tiny_chat_model):
    body = {"text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    out = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    prompt_ids = server.ctx.tokenizer.encode(body["text"])
    assert out["output_ids"] == hf_greedy(tiny_chat_model[1], prompt_ids, 8)
    assert out["text"] == server.ctx.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8} and meta["e2e_latency"] > 0


def test_generate_takes_batches_of_token_ids_and_returns_logprobs(server):
    body = {"input_ids": [[5, 6, 7], [8, 9]], "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": [{"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
                                {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}]}
    outs = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    assert [len(o["output_ids"]) for o in outs] == [3, 2]
    for out in outs:
        logprobs = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in logprobs] == out["output_ids"]
        tops = out["meta_info"]["output_top_logprobs"]
        assert all(len(alts) == 2 and alts[0][1] == t for alts, t in zip(tops, out["output_ids"]))


def test_generate_returns_prompt_logprobs_from_logprob_start_len_0(server):
    body = {"input_ids": [5, 6, 7, 8], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    meta = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == [5, 6, 7, 8]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert all(lp < 0 for lp, _, _ in meta["input_token_logprobs"][1:])
    response = httpx.post(server.base_url + "/generate", json={**body, "logprob_start_len": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprob_start_len"


def test_a_client_rid_names_the_answer_and_may_repeat(server):
    import concurrent.futures

    body = {"text": "Hi", "rid": "my-request", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda _: httpx.post(server.base_url + "/generate", json=body, timeout=60),
                                  range(2)))
    assert [r.status_code for r in responses] == [200, 200]
    assert [r.json()["meta_info"]["id"] for r in responses] == ["my-request", "my-request"]


def test_generate_stream_sends_cumulative_text(server):
    body = {"text": "Hello", "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [orjson.loads(line[6:]) for line in lines[:-1]]
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5]
    assert all(events[i + 1]["text"].startswith(events[i]["text"]) for i in range(4))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_rejects_bad_sampling_params_and_unknown_keys(server):
    for params in ({"temperature": -1}, {"max_new_tokens": 0}, {"bogus": 1}):
        response = httpx.post(server.base_url + "/generate", json={"text": "x", "sampling_params": params})
        assert response.status_code == 400 and response.json()["error"]["message"]


def test_health_model_info_server_info_and_flush_cache(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(server.base_url + "/get_model_info").json()
    assert info["is_generation"] is True  # the model by its directory's name, not its path
    assert info["model_path"] == os.path.basename(server.args.model_path)
    server_info = httpx.get(server.base_url + "/get_server_info").json()
    assert server_info["context_length"] == 512 and server_info["max_total_num_tokens"] >= 8192
    assert server_info["num_running_reqs"] == 0
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200


def test_health_is_503_until_the_warm_up_has_passed(server):
    server.ctx.ready = False
    try:
        response = httpx.get(server.base_url + "/health")
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    finally:
        server.ctx.ready = True


def test_metrics_count_tokens_requests_and_latencies(server, client):
    def value(text, name):
        line = next(line for line in text.splitlines() if line.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    before = httpx.get(server.base_url + "/metrics").text
    client.completions.create(model="tiny", prompt="one two three", max_tokens=4,
                              extra_body={"ignore_eos": True})
    after = httpx.get(server.base_url + "/metrics").text
    assert value(after, "xlaserve:generation_tokens_total") - value(before, "xlaserve:generation_tokens_total") == 4
    prompt_len = len(server.ctx.tokenizer.encode("one two three"))
    assert value(after, "xlaserve:prompt_tokens_total") - value(before, "xlaserve:prompt_tokens_total") == prompt_len
    assert value(after, "xlaserve:time_to_first_token_seconds_count") > value(before, "xlaserve:time_to_first_token_seconds_count")
    assert value(after, "xlaserve:inter_token_latency_seconds_count") - value(
        before, "xlaserve:inter_token_latency_seconds_count") == 3
    for gauge in ("xlaserve:num_running_reqs", "xlaserve:num_queue_reqs", "xlaserve:token_usage"):
        assert gauge in after
