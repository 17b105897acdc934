"""RL rollouts through the Engine (issue 75): weights updated in place from disk, from named
tensors and from a JAX trainer's arrays serve transformers' tokens and logprobs on the new
weights with no compile; requests in flight end on the old weights (or are aborted, as asked);
refused updates leave the old weights serving; released memory is freed and comes back;
generation pauses in each of SGLang's modes."""
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

from tests.hf_reference import hf_greedy
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.runtime.engine import WeightUpdateError
from xlaserve.runtime.engine.weight_updates import bytes_in_use
from xlaserve.runtime.executor import weight_swap
from xlaserve.weights.loader import load_model

PROMPT = [5, 17, 300, 42, 9, 77, 120]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 180, "temperature": 0, "ignore_eos": True}
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=256,
             max_total_tokens=1024)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one tiny config (A, B) and one of another (3 layers)."""
    root = tmp_path_factory.mktemp("weights")
    a, b, other = str(root / "a"), str(root / "b"), str(root / "other")
    models = make_tiny_checkpoint(a, "llama"), make_tiny_checkpoint(b, "llama", seed=1)
    make_tiny_checkpoint(other, "llama", num_hidden_layers=3)
    return (a, b, other), models


@pytest.fixture(scope="module")
def engine(checkpoints):
    with Engine(checkpoints[0][0], **SMALL) as engine:
        yield engine


@pytest.fixture
def at_a(engine, checkpoints):
    """The engine serving A, unpaused, whatever a test left."""
    yield
    weights = engine.core.weights
    if weights.sleeping():
        weights.resume()
    assert engine.update_weights_from_disk(checkpoints[0][0], weight_version="default")[0]
    weights.resume_generation()


def _greedy(engine, prompt=PROMPT, params=GREEDY):
    return engine.generate(input_ids=prompt, sampling_params=params)


def _in_thread(engine, params=LONG, until="running"):
    """A request started on a thread, once it is `until` (running, or waiting):
    (thread, its result holder)."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(_greedy(engine, params=params)))
    thread.start()
    scheduler, deadline = engine.core.scheduler, time.monotonic() + 30
    while (scheduler.num_running if until == "running" else scheduler.num_waiting) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return thread, result


def test_an_update_from_disk_serves_the_new_weights_without_a_compile(engine, checkpoints, at_a):
    (a, b, _), (hf_a, hf_b) = checkpoints
    assert _greedy(engine)["output_ids"] == hf_greedy(hf_a, PROMPT, 8)
    compiled = engine.core.runner.compile_count()
    assert engine.update_weights_from_disk(b, weight_version="step-1") == (
        True, "Succeeded to update model weights from disk.", 0)
    out = _greedy(engine)
    assert out["output_ids"] == hf_greedy(hf_b, PROMPT, 8) != hf_greedy(hf_a, PROMPT, 8)
    assert out["meta_info"]["weight_version"] == "step-1"
    assert engine.core.runner.compile_count() == compiled


def test_a_request_in_flight_ends_on_the_old_weights_or_is_aborted(engine, checkpoints, at_a):
    (a, b, _), (hf_a, hf_b) = checkpoints
    thread, result = _in_thread(engine)
    assert engine.update_weights_from_disk(b)[0]
    thread.join()  # the update waited for it: every token is A's
    assert result["output_ids"] == hf_greedy(hf_a, PROMPT, 180)
    thread, result = _in_thread(engine)
    assert engine.update_weights_from_disk(a, abort_all_requests=True)[0]
    thread.join()
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert _greedy(engine)["output_ids"] == hf_greedy(hf_a, PROMPT, 8)


def test_refused_updates_say_why_and_leave_the_old_weights_serving(engine, checkpoints, at_a):
    (a, b, other), (hf_a, hf_b) = checkpoints
    ok, message, _ = engine.update_weights_from_disk(other)
    assert not ok and "num_layers is 3" in message
    ok, message, _ = engine.update_weights_from_disk(a + "/missing")
    assert not ok and "not a file or directory" in message
    tensors = {name: t for name, t in hf_b.state_dict().items()}
    misshapen = dict(tensors, **{"model.norm.weight": torch.ones(65)})
    ok, message = engine.update_weights_from_tensor(list(misshapen.items()))
    assert not ok and "model.norm.weight" in message and "65" in message
    assert _greedy(engine)["output_ids"] == hf_greedy(hf_a, PROMPT, 8)
    ok, _ = engine.update_weights_from_tensor(list(tensors.items()))
    assert ok and _greedy(engine)["output_ids"] == hf_greedy(hf_b, PROMPT, 8)


def test_tensors_sent_in_buckets_change_the_weights_once_all_have_come(engine, checkpoints,
                                                                       at_a):
    (_, _, _), (hf_a, hf_b) = checkpoints
    tensors = list(hf_b.state_dict().items())
    last = "model.layers.1.mlp.down_proj.weight"
    first = [(n, t) for n, t in tensors if n != last]
    for held, bucket in ((5, first[:5]), (20, first[5:])):  # verl's: several calls
        ok, message = engine.update_weights_from_tensor(bucket)
        assert ok and message.startswith(f"held {held} of the 21 tensors"), message
        assert _greedy(engine)["output_ids"] == hf_greedy(hf_a, PROMPT, 8)
    assert f"({last!r} and 0 more)" in message  # the one still awaited, by name
    ok, message = engine.update_weights_from_tensor([(last, dict(tensors)[last])])
    assert (ok, message) == (True, "Succeeded to update model weights from tensors.")
    assert _greedy(engine)["output_ids"] == hf_greedy(hf_b, PROMPT, 8)


def test_released_memory_is_freed_and_resumed_from_the_host_copy(engine, checkpoints, at_a):
    (_, _, _), (hf_a, _) = checkpoints
    runner, weights = engine.core.runner, engine.core.weights
    held = (sum(a.nbytes for a in runner._weight_args[:runner.weights._count])
            + sum(c.nbytes for c in runner.kv_caches))
    figures = weights.release(backup=True)
    # Their buffers are gone. The figure is the process's live arrays on the CPU device: alone,
    # the bytes freed equal `held` to 1%; beside other tests' engines in this process, which
    # allocate between the two readings, only a bound holds.
    assert all(a is None for a in runner._weight_args[:runner.weights._count])
    assert not runner.kv_caches_held()
    assert figures["bytes_before"] - figures["bytes_after"] >= held // 2
    assert figures["bytes_after"] == bytes_in_use(runner.mesh)
    assert weights.sleeping()
    thread, result = _in_thread(engine, GREEDY, "waiting")  # queued while asleep: it waits
    time.sleep(0.3)
    assert not result and engine.core.scheduler.num_running == 0
    weights.resume()
    thread.join()
    assert result["output_ids"] == hf_greedy(hf_a, PROMPT, 8)


def test_weights_released_without_a_copy_wait_for_an_update(engine, checkpoints, at_a):
    (a, _, _), (hf_a, _) = checkpoints
    engine.release_memory_occupation(["weights"])  # --enable-weights-cpu-backup is off
    engine.resume_memory_occupation(["weights"])
    with pytest.raises(WeightUpdateError, match="update them first"):
        engine.continue_generation()
    thread, result = _in_thread(engine, GREEDY, "waiting")
    time.sleep(0.3)
    assert not result  # never served from the emptied weights
    assert engine.update_weights_from_disk(a)[0]
    thread.join()
    assert result["output_ids"] == hf_greedy(hf_a, PROMPT, 8)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_generation_in_each_mode(engine, checkpoints, mode, at_a):
    (_, _, _), (hf_a, _) = checkpoints
    thread, result = _in_thread(engine)
    engine.pause_generation(mode)
    scheduler = engine.core.scheduler
    if mode == "abort":
        thread.join()
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
    else:
        running = scheduler.num_running
        assert (running, scheduler.num_waiting) == ((0, 1) if mode == "retract" else (1, 0))
        computed = [r.num_computed for r in scheduler.running]
        time.sleep(0.2)
        assert [r.num_computed for r in scheduler.running] == computed and not result
    engine.continue_generation()
    thread.join()
    if mode != "abort":
        assert result["output_ids"] == hf_greedy(hf_a, PROMPT, 180)


def _bigram_step(params: dict, tokens: np.ndarray) -> dict:
    """One optax AdamW step of a JAX trainer on `params` (Hugging Face names, jax.Arrays): a
    bigram loss through the embedding, final norm and LM head; weight decay moves every
    weight."""
    def loss(p):
        x = p["model.embed_tokens.weight"][tokens[:-1]]
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["model.norm.weight"]
        logits = x @ p["lm_head.weight"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[1:]).mean()
    optimizer = optax.adamw(1e-2, weight_decay=0.5)
    updates, _ = optimizer.update(jax.grad(loss)(params), optimizer.init(params), params)
    return optax.apply_updates(params, updates)


def test_a_jax_trainer_updates_the_engine_in_process(engine, checkpoints, at_a):
    (a, _, _), (hf_a, _) = checkpoints
    params = {n: jnp.asarray(t.numpy()) for n, t in hf_a.state_dict().items()}
    trained = _bigram_step(params, np.array(PROMPT * 4))
    compiled = engine.core.runner.compile_count()
    engine.update_weights(trained, weight_version="step-2")
    hf_a.load_state_dict({n: torch.from_numpy(np.asarray(v)) for n, v in trained.items()})
    try:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
        assert out["output_ids"] == hf_greedy(hf_a, PROMPT, 8)
        with torch.no_grad():
            ids = torch.tensor([PROMPT + out["output_ids"]])
            logprobs = torch.log_softmax(hf_a(ids).logits[0].double(), -1)
        expected = [logprobs[len(PROMPT) - 1 + i, t].item()
                    for i, t in enumerate(out["output_ids"])]
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(got, expected, atol=1e-4)
    finally:
        hf_a.load_state_dict({n: torch.from_numpy(np.asarray(v)) for n, v in params.items()})
    assert out["meta_info"]["weight_version"] == "step-2"
    assert engine.core.runner.compile_count() == compiled


def test_an_nnx_state_of_the_model_updates_the_engine(engine, checkpoints, at_a):
    (_, b, _), (hf_a, hf_b) = checkpoints
    trainer = load_model(b, dtype="float32", mesh=engine.core.runner.mesh,
                         skip_tokenizer_init=True, progress=False)
    engine.update_weights(nnx.state(trainer.model))
    assert _greedy(engine)["output_ids"] == hf_greedy(hf_b, PROMPT, 8)
    with pytest.raises(WeightUpdateError, match="nnx.State or a dict"):
        engine.update_weights([1, 2])


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(engine, checkpoints, tmp_path,
                                                           at_a):
    (_, b, _), (hf_a, hf_b) = checkpoints
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(f"{b}/config.json", broken)
    tensors = {n: t.contiguous() for n, t in hf_b.state_dict().items()
               if n != "model.layers.0.self_attn.k_proj.weight"}
    save_file(tensors, str(broken / "model.safetensors"))
    ok, message, _ = engine.update_weights_from_disk(str(broken))
    assert not ok and "model.layers.0.self_attn.k_proj.weight" in message
    assert _greedy(engine)["output_ids"] == hf_greedy(hf_a, PROMPT, 8)


def test_int8_serving_requantizes_updated_weights_on_the_device(checkpoints):
    """--quantization int8: a float update is quantized where it lands, as loading does: the
    same tokens and logprobs as an engine started on the new checkpoint."""
    (a, b, _), (_, hf_b) = checkpoints
    int8 = dict(SMALL, quantization="int8")
    with Engine(b, **int8) as fresh:
        expected = fresh.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    with Engine(a, **int8) as engine:
        engine.update_weights({n: t for n, t in hf_b.state_dict().items()})
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert out["output_ids"] == expected["output_ids"]
    assert out["meta_info"]["output_token_logprobs"] == expected["meta_info"][
        "output_token_logprobs"]


def test_get_weights_by_name_reads_a_bounded_number_of_values(engine, monkeypatch):
    name = engine.core.runner.weights.leaf_names()[0]
    assert len(engine.get_weights_by_name(name, 2)) == 2
    monkeypatch.setattr(weight_swap, "MAX_VALUES_READ", 10)
    with pytest.raises(WeightUpdateError, match="ask for fewer"):
        engine.get_weights_by_name(name, 2)
