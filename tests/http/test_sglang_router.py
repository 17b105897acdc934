"""SGLang's router (`sglang-router` 0.3.2 from PyPI, a Rust binary: `python -m
sglang_router.launch_router --policy cache_aware`) and its newer form, the model gateway (`smg`
1.13.0: `python -m smg.launch_router`), each in front of two xlaserve servers (two apps over the
tiny model's one engine, each counting what reaches it): it registers both as SGLang workers
(smg's /workers says runtime_type sglang, with their loads from /v1/loads), answers every route
as a server answers it itself, spreads requests over both, and routes around one that stopped.
And what the newer gateway reads of a worker: /server_info, /model_info, /v1/loads, /get_load in
SGLang's shapes (http/worker_info.py)."""
import concurrent.futures
import dataclasses
import subprocess
import sys
import time

import httpx
import pytest

from tests.http.conftest import AppServer, _free_port


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "temperature": 0,
        "max_tokens": 6}


class Counted:
    """An ASGI app that records the paths of the requests that reach it."""

    def __init__(self, app):
        self.app, self.paths = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.fixture(scope="module", params=["sglang_router", "smg"])
def gateway(request) -> str:
    """The router's package: SGLang's PyPI release, or its newer form."""
    pytest.importorskip(request.param)
    return request.param


@pytest.fixture(scope="module")
def workers(server, gateway):  # two fresh ones per gateway: a test stops one
    from xlaserve.http.app import create_app

    started = []
    for _ in range(2):
        ctx = dataclasses.replace(server.ctx)
        app = Counted(create_app(ctx))
        started.append((AppServer(app, ctx), app))
    yield started
    for running, _ in started:
        running.close()


@pytest.fixture(scope="module")
def router(gateway, workers, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", f"{gateway}.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--policy", "cache_aware", "--log-level", "warn",
             "--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0",
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--cb-failure-threshold", "1",
             *(["--load-monitor-interval", "1"] if gateway == "smg" else []),
             "--worker-urls", *(running.base_url for running, _ in workers)],
            stdout=out, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # both workers registered: a request through the router is answered
        try:
            if httpx.post(base_url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200 \
                    and all("/server_info" in app.paths for _, app in workers):
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail("the router did not route:\n" + log.read_text()[-3000:])
        time.sleep(0.3)
    yield base_url
    process.terminate()
    process.wait(timeout=30)


def _without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_the_router_registers_both_servers_as_sglang_workers(router, workers, gateway):
    """Both register a worker by /health, then /server_info and /model_info (SGLang's names);
    smg lists them as SGLang workers with the load /v1/loads reports."""
    for _, app in workers:
        assert {"/health", "/server_info", "/model_info"} <= set(app.paths)
    if gateway == "smg":  # 0.3.2's /workers names no runtime
        deadline = time.monotonic() + 15
        while True:  # its load monitor polls each worker's /v1/loads every second here
            entries = httpx.get(router + "/workers", timeout=10).json()["workers"]
            if all("engine_load" in e for e in entries) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert sorted(w["url"] for w in entries) == sorted(r.base_url for r, _ in workers)
        for entry in entries:
            assert entry["runtime_type"] == "sglang" and entry["is_healthy"], entry
            assert entry["engine_load"]["loads"][0]["max_total_num_tokens"] > 0, entry


def test_every_route_answers_as_a_server_does(router, server):
    completion = {"model": "tiny", "prompt": "The sky is", "temperature": 0, "max_tokens": 6}
    generate = {"text": "The sky is", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", completion),
                       ("/generate", generate)):
        routed = httpx.post(router + path, json=body, timeout=60)
        direct = httpx.post(server.base_url + path, json=body, timeout=60)
        assert routed.status_code == direct.status_code == 200, routed.text
        if path == "/generate":
            assert routed.json()["text"] == direct.json()["text"]
        else:
            assert _without_ids(routed.json())["choices"] == _without_ids(direct.json())["choices"]
    streamed = httpx.post(router + "/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=60)
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert httpx.get(router + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


def test_requests_spread_over_both_servers_and_a_stopped_one_is_routed_around(router, workers):
    before = [app.paths.count("/v1/chat/completions") for _, app in workers]
    # Eight at once, each 64 tokens long: cache_aware sends a request to the server with fewer
    # in flight once they differ by more than its balance thresholds (set low here: the
    # defaults, 64 requests, suit real loads, not a test's eight).
    body = {**CHAT, "max_tokens": 64, "logit_bias": {"2": -100, "0": -100}}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: httpx.post(
            router + "/v1/chat/completions", json=body, timeout=120).status_code, range(8)))
    assert statuses == [200] * 8
    served = [app.paths.count("/v1/chat/completions") - b for (_, app), b in zip(workers, before)]
    assert min(served) >= 1 and sum(served) == 8, served
    # One server stops: the router's health check (every second here) or its circuit breaker
    # (open at the first failure here) takes it out, and every request goes to the other.
    workers[1][0].close()
    deadline = time.monotonic() + 15
    while httpx.post(router + "/v1/chat/completions", json=CHAT, timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the router kept sending to the stopped server"
        time.sleep(0.5)
    for i in range(4):
        body = {**CHAT, "messages": [{"role": "user", "content": f"again {i}"}]}
        response = httpx.post(router + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text


def test_the_newer_gateways_reads_answer_in_sglangs_shapes(server):
    """What smg reads: /server_info answers (its SGLang test; /version, vLLM's, does not),
    /model_info's fields, /v1/loads' per-rank figures and /get_load's summed num_tokens."""
    info = httpx.get(server.base_url + "/server_info", timeout=10).json()
    assert (info["served_model_name"], info["tp_size"], info["dp_size"]) == ("tiny", 1, 1)
    assert "model_id" not in info and "model" not in info  # both at once fail its parse
    assert httpx.get(server.base_url + "/version", timeout=10).status_code == 404
    model = httpx.get(server.base_url + "/model_info", timeout=10).json()
    assert model["is_generation"] and model["architectures"] == ["Qwen2ForCausalLM"]
    loads = httpx.get(server.base_url + "/v1/loads?include=core,disagg,queues,memory",
                      timeout=10).json()
    assert loads["dp_rank_count"] == 1 and isinstance(loads["timestamp"], str)
    (rank,) = loads["loads"]
    assert rank["dp_rank"] == 0 and 0 <= rank["token_usage"] <= 1
    assert rank["max_total_num_tokens"] > 0 and rank["num_total_reqs"] >= 0
    (load,) = httpx.get(server.base_url + "/get_load", timeout=10).json()
    assert isinstance(load["num_tokens"], int) and load["num_tokens"] == rank["num_used_tokens"]
    for query, says in (("format=prometheus", "format"), ("include=cpu", "include"),
                        ("dp_rank=3", "dp_rank")):
        response = httpx.get(server.base_url + "/v1/loads?" + query, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == says
