"""LoRA adapters through the Engine (issue 53): base and adapter rows in one batch give
transformers + peft's greedy tokens; adapters load and unload while serving without a compile;
a name that is not loaded is refused, never answered by the base model; the prefix cache keeps
adapters apart. The engine has two slots and loads three adapters (issue 73): the third waits in
host memory and the adapters take turns in the slots as requests need them."""
import threading

import pytest

from tests.hf_reference import hf_greedy
from tests.lora.peft_adapters import make_adapter
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.runtime.engine.lora_adapters import UnknownAdapter
from xlaserve.weights.lora_adapter import LoraAdapterError

PROMPTS = [[5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13], [1, 2], [99, 7, 7, 7],
           [400, 401, 402, 403, 404, 405, 406, 407, 408, 409]]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=8,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=64,
             max_total_tokens=1024)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base_dir = str(root / "base")
    base = make_tiny_checkpoint(base_dir, "llama")
    adapters = {
        # attention only, rank 4
        "a": (str(root / "a"), dict(r=4, targets=["q_proj", "v_proj"], alpha=8, seed=1)),
        # every module, rank 8, rsLoRA
        "b": (str(root / "b"), dict(r=8, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"],
                                    alpha=16, seed=2, use_rslora=True)),
        # the MLP only, rank 2; loaded while serving
        "c": (str(root / "c"), dict(r=2, targets=["gate_proj", "down_proj"], alpha=2, seed=3)),
    }
    merged = {name: make_adapter(base_dir, path, **kw) for name, (path, kw) in adapters.items()}
    return base_dir, base, {n: p for n, (p, _) in adapters.items()}, merged


@pytest.fixture(scope="module")
def engine(models):
    base_dir, _, paths, _ = models
    with Engine(base_dir, lora_paths=[f"a={paths['a']}", f"b={paths['b']}"],
                lora_target_modules=["all"], max_loras_per_batch=2, max_loaded_loras=3,
                **SMALL) as engine:
        yield engine


def test_base_and_adapter_rows_in_one_batch_equal_transformers_with_peft(engine, models):
    _, base, _, merged = models
    adapters = [None, "a", "b", "a"]
    results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=adapters)
    for prompt, adapter, result in zip(PROMPTS, adapters, results, strict=True):
        oracle = base if adapter is None else merged[adapter]
        assert result["output_ids"] == hf_greedy(oracle, prompt, 10), adapter
    # the adapters change the answer: a test that cannot fail would not notice them missing
    assert hf_greedy(merged["a"], PROMPTS[0], 10) != hf_greedy(base, PROMPTS[0], 10)
    assert hf_greedy(merged["b"], PROMPTS[2], 10) != hf_greedy(base, PROMPTS[2], 10)


def test_same_prompt_under_two_adapters_shares_no_kv(engine, models):
    _, base, _, merged = models
    prompt = PROMPTS[0] + PROMPTS[3]  # whole pages a prefix cache would share
    for adapter in ("a", None, "b", "a"):
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=adapter)
        oracle = base if adapter is None else merged[adapter]
        assert out["output_ids"] == hf_greedy(oracle, prompt, 10), adapter


def test_an_adapter_not_loaded_is_refused_not_answered_by_the_base_model(engine):
    with pytest.raises(UnknownAdapter, match="'nope' is not loaded"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="nope")


def test_load_and_unload_while_serving_without_a_compile(engine, models):
    _, base, paths, merged = models
    compiled = engine.core.runner.compile_count()
    assert engine.core.runner.lora._compiled is not None  # the slot write: precompiled too
    results = {}

    def traffic():
        results["base"] = engine.generate(input_ids=[PROMPTS[1]] * 4, sampling_params=GREEDY)

    thread = threading.Thread(target=traffic)
    thread.start()
    engine.load_lora_adapter("c", paths["c"])
    out = engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY, lora_path=["c", "b"])
    thread.join()
    assert out[0]["output_ids"] == hf_greedy(merged["c"], PROMPTS[0], 10)
    assert out[1]["output_ids"] == hf_greedy(merged["b"], PROMPTS[1], 10)
    expected = hf_greedy(base, PROMPTS[1], 10)
    assert all(r["output_ids"] == expected for r in results["base"])
    with pytest.raises(LoraAdapterError, match="3 LoRA adapters are loaded, --max-loaded-loras 3"):
        engine.load_lora_adapter("d", paths["a"])
    engine.unload_lora_adapter("c")
    with pytest.raises(UnknownAdapter):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="c")
    engine.load_lora_adapter("c2", paths["c"])  # the freed slot, another name
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="c2")
    assert out["output_ids"] == hf_greedy(merged["c"], PROMPTS[0], 10)
    engine.unload_lora_adapter("c2")
    assert engine.core.runner.compile_count() == compiled


TP_SCRIPT = """
import json, sys
from xlaserve.offline import Engine
base, a, b, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
with Engine(base, tp_size=2, lora_paths=[f"a={a}", f"b={b}"], **json.loads(sys.argv[5])) as engine:
    out = engine.generate(input_ids=prompts, sampling_params=json.loads(sys.argv[6]),
                          lora_path=[None, "a", "b", "b"])
print("RESULT " + json.dumps([o["output_ids"] for o in out]))
"""


def test_adapters_split_over_two_devices_like_their_base_weights(models):
    """Tensor parallelism shards a and b as their base weights (qkv's kv heads, o_proj's and
    down's inputs, gate and up's intermediate): tp 2 gives transformers + peft's tokens."""
    import json
    import os
    import subprocess
    import sys

    base_dir, base, paths, merged = models
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu", "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, base_dir, paths["a"], paths["b"], json.dumps(PROMPTS),
         json.dumps({**SMALL, "lora_target_modules": ["all"]}), json.dumps(GREEDY)],
        capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stdout[-3000:] + result.stderr[-5000:]
    outputs = json.loads(lines[-1][len("RESULT "):])
    for prompt, adapter, output in zip(PROMPTS, [None, "a", "b", "b"], outputs, strict=True):
        oracle = base if adapter is None else merged[adapter]
        assert output == hf_greedy(oracle, prompt, 10), adapter


def test_three_adapters_take_turns_in_two_slots_without_a_compile(engine, models, caplog):
    """Rows of three adapters (and the base model) in one call on two slots: each adapter is
    written into a slot when its requests' turn comes (the others wait, none fails), and every
    row gives transformers + peft's tokens; the writes compile nothing. The one left out of the
    slots unloads at once."""
    _, base, paths, merged = models
    engine.load_lora_adapter("c", paths["c"])  # three adapters for two slots
    runner, slots = engine.core.runner, engine.core.features.lora.slots
    compiled, swaps = runner.compile_count(), slots.swaps
    adapters = ["c", "a", "b", None, "c", "b", "a", "c"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]
    with caplog.at_level("WARNING"):
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=adapters)
    for prompt, adapter, result in zip(prompts, adapters, results, strict=True):
        oracle = base if adapter is None else merged[adapter]
        assert result["output_ids"] == hf_greedy(oracle, prompt, 10), adapter
    assert slots.swaps >= swaps + 2  # c in, then the one it pushed out back
    assert runner.compile_count() == compiled and "COMPILED WHILE SERVING" not in caplog.text
    # the adapter in no slot now unloads at once, its host copy dropped; it loads again
    lora = engine.core.features.lora
    (waiting,) = [n for n in "abc" if lora.loaded[n].key not in slots.slot_of]
    engine.unload_lora_adapter(waiting)
    assert waiting not in {a.name for a in lora.cards()} and len(lora._by_key) == 2
    engine.load_lora_adapter(waiting, paths[waiting])
    engine.unload_lora_adapter("c")
