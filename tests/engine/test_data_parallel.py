"""Data parallel replicas (`--dp-size`): the dispatching with stand-in replicas, then the real
thing on 8 fake CPU devices (a subprocess: the device count is fixed when JAX starts), where
`--dp-size 2 --tp-size 4` gives the tokens of one device and of tp=4 alone, both replicas serve,
an abort finds its replica, and the HTTP server shows each replica's figures."""
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tests.tiny_models import make_tiny_checkpoint
from xlaserve.runtime.engine.data_parallel import DataParallelEngineCore
from xlaserve.runtime.engine.messages import Finish, OutputDelta
from xlaserve.runtime.engine.startup import Features
from xlaserve.runtime.sampling.params import SamplingParams
from xlaserve.server_args import ServerArgs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- the dispatching, with stand-in replicas ---------------------------------------------------

class FakeReplica:
    """What DataParallelEngineCore uses of an EngineCore; requests finish when the test says."""

    def __init__(self, rank: int):
        self.rank = rank
        self.args = SimpleNamespace(page_size=4)
        self.loaded = self.tokenizer = self.grammar_backend = None
        self.features = Features()  # a text generation server's
        self.context_length = 64
        self.eos_token_ids = {0}
        self.runner = SimpleNamespace(compile_count=lambda: 1 + rank, page_size=4)
        self.live: dict[str, tuple] = {}  # rid -> (emit, params)
        self.aborted: list[str] = []
        self.alive = True
        self.failure = None

    def submit(self, prompt_ids, params, emit, rid=None, **options):
        if prompt_ids == [666]:
            raise ValueError("refused")
        self.live[rid] = (emit, params)
        return rid

    def finish(self, rid: str) -> None:
        emit, _ = self.live.pop(rid)
        emit(OutputDelta(None, "", True, finish=Finish(rid, "stop", None, 1, 0, 0)))

    def abort(self, rid, message=None):
        self.aborted.append(rid)

    def stats(self):
        return {"num_running_reqs": len(self.live), "num_queue_reqs": self.rank,
                "token_usage": 0.5 * self.rank}

    max_total_num_tokens = 256
    max_request_tokens = 64

    def flush_cache(self):
        return 3

    def shutdown(self):
        self.alive = False

    def is_alive(self):
        return self.alive

    def stopped_reason(self):
        return self.failure


def fake_core(method: str, n: int = 2, random_seed: int | None = 0):
    args = ServerArgs(dp_size=n, load_balance_method=method, random_seed=random_seed)
    replicas = [FakeReplica(i) for i in range(n)]
    return DataParallelEngineCore(args, replicas=replicas), replicas


def test_a_lora_path_to_a_data_parallel_server_is_refused_by_name():
    """--dp-size serves no adapters (--enable-lora runs one replica): a request naming one is the
    400 a single replica gives (lora_not_found), read from the replicas' one Features record."""
    from xlaserve.http.errors import APIError
    from xlaserve.http.serving import ServingContext

    core, _ = fake_core("round_robin")
    engine = SimpleNamespace(core=core, server_args=ServerArgs(model_path="m"))
    ctx = ServingContext(engine, "m", "m", None, frozenset(), None, 1, None)
    assert ctx.adapters_of("m", None) is None
    with pytest.raises(APIError) as refused:
        ctx.adapters_of("m", "an-adapter")
    assert (refused.value.status, refused.value.param, refused.value.code) == (
        400, "lora_path", "lora_not_found")


def submit(core, rid=None, prompt=(1, 2), params=None):
    chunks = []
    return core.submit(list(prompt), params or SamplingParams(), chunks.append, rid=rid), chunks


def test_round_robin_takes_the_replicas_in_turn():
    core, replicas = fake_core("round_robin", n=3)
    rids = [submit(core)[0] for _ in range(7)]
    assert [core.replica_of(r) for r in rids] == [0, 1, 2, 0, 1, 2, 0]
    assert core.dispatched == [3, 2, 2]
    assert [len(r.live) for r in replicas] == [3, 2, 2]


def test_shortest_queue_picks_the_replica_with_the_fewest_unfinished_requests():
    core, replicas = fake_core("shortest_queue", n=2)
    burst = [submit(core)[0] for _ in range(4)]
    assert [core.replica_of(r) for r in burst] == [0, 1, 0, 1]  # a burst spreads, ties to rank 0
    for rid in burst[1::2]:
        replicas[1].finish(rid)  # replica 1 drained: 2 vs 0 unfinished
    later = [submit(core)[0] for _ in range(3)]
    assert [core.replica_of(r) for r in later] == [1, 1, 0]
    assert core.replica_of(burst[1]) is None  # forgotten with its final chunk


def test_abort_goes_to_the_replica_that_has_the_request():
    core, replicas = fake_core("round_robin")
    first, second = submit(core, rid="a")[0], submit(core, rid="b")[0]
    core.abort(second)
    core.abort("unknown")  # finished or never seen: nothing to do
    assert replicas[1].aborted == ["b"] and replicas[0].aborted == []
    replicas[0].finish(first)
    core.abort(first)
    assert replicas[0].aborted == []


def test_a_refused_request_and_a_failing_consumer_leave_no_trace():
    core, replicas = fake_core("shortest_queue")
    with pytest.raises(ValueError):
        submit(core, prompt=[666])
    assert core._unfinished == [0, 0] and core._where == {}

    def broken(chunk):
        raise RuntimeError("consumer gone")

    rid = core.submit([1], SamplingParams(), broken)
    with pytest.raises(RuntimeError):
        replicas[0].finish(rid)
    assert core._unfinished == [0, 0] and core._where == {}


def test_a_duplicate_id_goes_to_the_replica_of_its_namesake():
    core, replicas = fake_core("round_robin")
    submit(core, rid="same")
    submit(core, rid="same")  # the replica's scheduler refuses it, as one engine would
    assert core.dispatched == [1, 0] and core.replica_of("same") == 0


def test_unseeded_requests_get_distinct_seeds_from_one_stream():
    core, replicas = fake_core("round_robin", random_seed=7)
    for _ in range(4):
        submit(core)
    submit(core, params=SamplingParams(seed=42))
    seeds = [p.seed for r in replicas for _, p in r.live.values()]
    assert len(set(seeds[:2] + seeds[3:])) == 4 and 42 in seeds  # replica 0: 3, replica 1: 2
    again, again_replicas = fake_core("round_robin", random_seed=7)
    for _ in range(4):
        submit(again)
    assert sorted(p.seed for r in again_replicas for _, p in r.live.values()) == \
        sorted(s for s in seeds if s != 42)  # --random-seed makes them reproducible


def test_stats_sum_the_replicas_and_list_each():
    core, replicas = fake_core("round_robin")
    submit(core)
    stats = core.stats()
    assert stats["num_running_reqs"] == 1 and stats["num_queue_reqs"] == 1
    assert stats["token_usage"] == pytest.approx(0.25)
    assert [(r["dp_rank"], r["num_running_reqs"], r["num_dispatched_reqs"])
            for r in stats["replicas"]] == [(0, 1, 1), (1, 0, 0)]
    assert core.runner.compile_count() == 3 and core.runner.page_size == 4
    assert core.flush_cache() == 6 and core.max_total_num_tokens == 256
    assert core.is_alive()
    replicas[1].alive, replicas[1].failure = False, "stuck"
    assert not core.is_alive()  # one dead replica fails /health, and says which and why
    assert core.stopped_reason() == "[DP1] stuck"


def test_dp_with_several_nodes_is_refused():
    with pytest.raises(ValueError, match="router"):
        DataParallelEngineCore(ServerArgs(dp_size=2, nnodes=2), replicas=[FakeReplica(0)])


# --- the real thing, on 8 fake CPU devices --------------------------------------------------

SCRIPT = textwrap.dedent("""
    import json, queue, sys, threading, time
    import httpx, jax, uvicorn
    from xlaserve.launch_server import build_app, main, make_context
    from xlaserve.offline import Engine
    from xlaserve.runtime.sampling.params import SamplingParams
    from xlaserve.server_args import ServerArgs

    path, storage, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert len(jax.devices()) == 8, jax.devices()
    # One program per replica: every step is padded to 16 tokens and 4 sequences.
    SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
                 chunked_prefill_size=8, max_prefill_tokens=12, context_length=64,
                 max_total_tokens=256, precompile_token_paddings="16", random_seed=0)
    PROMPTS = [[5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13], [1, 2],
               [400 + i for i in range(20)], [99], [7, 7, 7, 7, 7, 7, 7], [33, 44, 55, 66]]
    PARAMS = [{"max_new_tokens": 6 + i % 4, "temperature": 0, "ignore_eos": True}
              for i in range(len(PROMPTS))]
    out = {}

    def greedy(engine):
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]

    with Engine(path, tp_size=1, **SMALL) as engine:
        out["tp1"] = greedy(engine)
    with Engine(path, tp_size=4, **SMALL) as engine:
        out["tp4"] = greedy(engine)
    # Speculative decoding in each replica (its own scheduler drafts); a biased token repeats,
    # so both replicas' requests verify drafts.
    with Engine(path, tp_size=4, dp_size=2, speculative_algorithm="NGRAM", **SMALL) as engine:
        out["dp2_ngram"] = greedy(engine)
        biased = engine.generate(input_ids=[[1, 7]] * 2, sampling_params={
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "logit_bias": {7: 100.0}})
        out["dp2_ngram_biased"] = [o["output_ids"] for o in biased]
        out["dp2_ngram_verified"] = [r.scheduler.speculator.verified_rows for r in engine.core.replicas]

    try:  # more devices than the host has: refused before anything loads
        Engine(path, tp_size=4, dp_size=3, **SMALL)
    except ValueError as error:
        out["too_many"] = str(error)
    out["too_many_rc"] = main(["--model-path", path, "--tp-size", "4", "--dp-size", "3",
                              "--skip-tokenizer-init", "--file-storage-path", storage + "-refused"])

    args = ServerArgs(model_path=path, tp_size=4, dp_size=2, enable_metrics=True,
                      served_model_name="tiny", file_storage_path=storage, **SMALL)
    ctx = make_context(args)
    engine, core = ctx.engine, ctx.engine.core
    out["devices"] = [[d.id for d in r.loaded.mesh.devices.flat] for r in core.replicas]
    out["threads"] = sorted(t.name for t in threading.enumerate()
                            if t.name.startswith("xlaserve-engine"))
    out["shared_grammar"] = core.replicas[0].grammar_backend is core.replicas[1].grammar_backend
    compiled = core.runner.compile_count()
    out["compiled_at_start"] = compiled
    before = list(core.dispatched)
    out["dp2"] = greedy(engine)
    out["dp2_dispatched"] = [a - b for a, b in zip(core.dispatched, before)]

    # n > 1 without a seed: the choices on different replicas sample differently.
    sampled = engine.generate(input_ids=[3, 4, 5], sampling_params={
        "n": 2, "temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True})
    out["n2_differ"] = sampled[0]["output_ids"] != sampled[1]["output_ids"]

    # An abort reaches the replica that runs the request.
    sinks = [queue.Queue(), queue.Queue()]
    long = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    rids = [core.submit(PROMPTS[i], long, sinks[i].put) for i in range(2)]
    on = [core.replica_of(r) for r in rids]
    victim = on.index(1)
    core.abort(rids[victim])

    def final(sink):
        while not (output := sink.get(timeout=120)).finished:
            pass
        return output.finish.meta_info()

    metas = [final(s) for s in sinks]
    out["abort"] = {"replicas": on, "victim": metas[victim]["finish_reason"]["type"],
                    "victim_tokens": metas[victim]["completion_tokens"],
                    "other": metas[1 - victim]["finish_reason"],
                    "forgotten": [core.replica_of(r) for r in rids]}

    # shortest_queue: a burst submitted at once is spread.
    core.load_balance_method = "shortest_queue"
    before = list(core.dispatched)
    out["sq"] = greedy(engine)
    out["sq_dispatched"] = [a - b for a, b in zip(core.dispatched, before)]
    out["compiled_while_serving"] = core.runner.compile_count() - compiled

    # The HTTP server on top: /generate, per-replica /metrics and /get_server_info.
    server = uvicorn.Server(uvicorn.Config(build_app(args, ctx), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    body = {"input_ids": PROMPTS, "sampling_params": PARAMS}
    out["http"] = [o["output_ids"] for o in httpx.post(base + "/generate", json=body, timeout=120).json()]
    out["metrics"] = httpx.get(base + "/metrics").text
    out["server_info"] = httpx.get(base + "/get_server_info").json()
    out["flush"] = httpx.post(base + "/flush_cache", timeout=60).status_code
    server.should_exit = True
    thread.join(timeout=30)
    core.shutdown()
    out["alive_after_shutdown"] = core.is_alive()
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    from tests.http.conftest import _free_port

    directory = str(tmp_path_factory.mktemp("tiny-llama-kv4"))
    # 4 kv heads, so that tp=4 gives each device one.
    make_tiny_checkpoint(directory, "llama", num_key_value_heads=4)
    storage = str(tmp_path_factory.mktemp("storage"))
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error"}
    if os.environ.get("XLASERVE_TEST_CACHE_DIR"):
        env["XLASERVE_TEST_CACHE_DIR"] = os.environ["XLASERVE_TEST_CACHE_DIR"]
    result = subprocess.run([sys.executable, "-c", SCRIPT, directory, storage, str(_free_port())],
                            capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_dp2_tp4_gives_the_tokens_of_tp4_and_of_one_device(eight_devices):
    """Over 20 s: the first test of the module pays `eight_devices`, one process of 8 CPU
    devices that builds and runs each engine the module compares (tp1, tp4, dp2, ...)."""
    assert eight_devices["tp4"] == eight_devices["tp1"]
    assert eight_devices["dp2"] == eight_devices["tp1"]
    assert eight_devices["sq"] == eight_devices["tp1"]
    assert eight_devices["http"] == eight_devices["tp1"]


def test_each_replica_speculates_and_gives_the_tokens_of_one_device(eight_devices):
    assert eight_devices["dp2_ngram"] == eight_devices["tp1"]
    assert eight_devices["dp2_ngram_biased"] == [[7] * 12] * 2
    assert all(n > 0 for n in eight_devices["dp2_ngram_verified"])  # both replicas drafted


def test_replicas_hold_disjoint_device_slices_and_run_their_own_loops(eight_devices):
    assert eight_devices["devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert eight_devices["threads"] == ["xlaserve-engine-dp0", "xlaserve-engine-dp1"]
    assert eight_devices["shared_grammar"]
    assert eight_devices["compiled_at_start"] == 2  # one program, compiled by each replica
    assert eight_devices["compiled_while_serving"] == 0
    assert not eight_devices["alive_after_shutdown"]


def test_both_replicas_serve_under_either_method(eight_devices):
    assert eight_devices["dp2_dispatched"] == [3, 3]  # round robin
    assert eight_devices["sq_dispatched"] == [3, 3]  # a burst spread by shortest_queue
    assert eight_devices["n2_differ"]


def test_abort_reaches_the_replica_running_the_request(eight_devices):
    abort = eight_devices["abort"]
    assert sorted(abort["replicas"]) == [0, 1]
    assert abort["victim"] == "abort" and abort["victim_tokens"] < 40
    assert abort["other"] == {"type": "length", "length": 40}
    assert abort["forgotten"] == [None, None]


def test_more_devices_than_the_host_has_fail_at_start_up_saying_what_was_found(eight_devices):
    message = eight_devices["too_many"]
    assert "--dp-size 3 x --tp-size 4 needs 12 devices; found 8 cpu devices" in message, message
    assert eight_devices["too_many_rc"] == 2  # launch_server logs it and exits


def test_metrics_and_server_info_show_each_replica(eight_devices):
    metrics = eight_devices["metrics"]
    for rank in (0, 1):
        for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage"):
            assert f'xlaserve:{gauge}{{dp_rank="{rank}",model_name="tiny"}}' in metrics, metrics
    info = eight_devices["server_info"]
    assert info["dp_size"] == 2 and info["num_running_reqs"] == 0
    assert info["max_total_num_tokens"] == 256
    assert [r["dp_rank"] for r in info["replicas"]] == [0, 1]
    assert all(r["max_total_num_tokens"] == 256 and r["num_dispatched_reqs"] > 0
               for r in info["replicas"])
    assert eight_devices["flush"] == 200
