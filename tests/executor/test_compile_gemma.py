"""Gemma's serving step at its published text shapes compiled for TPU v6e and H100 at tp 4
without the hardware (runtime/executor/aot.py): local sliding-window layers and global ones, each
with its own RoPE table, through the platform's Pallas attention (Mosaic, Triton). Gemma 3 27B
(benchmarks/configs/gemma-3-27b-text) and Gemma 4 31B (gemma-4-31b-text: its global layers' heads
twice as wide and a quarter as many, each layer's cache its own shape). CI compiles Gemma 4's
first six layers (five local, one global); the whole models run under --slow (the figures in
docs/tpu-gpu.md)."""
import json

import pytest

from tests.compile_targets import CONFIGS, cache_copies, devices, weight_bytes
from xlaserve.runtime.executor import aot
from xlaserve.runtime.sampling.step_needs import PLAIN
from xlaserve.server_args import ServerArgs

# Each model's text decoder in bfloat16 (27.01B and 30.81B parameters), and its layer count.
MODELS = {"gemma-3-27b-text": (54.02e9, 62, "Gemma3ForCausalLM"),
          "gemma-4-31b-text": (61.61e9, 60, "Gemma4ForCausalLM")}
CASES = [pytest.param("gemma-4-31b-text", 6, id="gemma4-local-and-global"),
         pytest.param("gemma-4-31b-text", None, id="gemma4-whole", marks=pytest.mark.slow),
         pytest.param("gemma-3-27b-text", 2, id="gemma3-local-and-global",
                      marks=pytest.mark.slow),
         pytest.param("gemma-3-27b-text", None, id="gemma3-whole", marks=pytest.mark.slow)]


def _model_path(name: str, layers: int | None, directory) -> str:
    """The config, or its first `layers` layers with their layer_types written out (Gemma 3's
    config has only sliding_window_pattern 6, whose first 2 layers are both local)."""
    if layers is None:
        return str(CONFIGS / name)
    whole = json.loads((CONFIGS / name / "config.json").read_text())
    kinds = whole.get("layer_types") or ["sliding_attention", "full_attention"]
    cut = {**whole, "num_hidden_layers": layers, "layer_types": kinds[:layers]}
    (directory / "config.json").write_text(json.dumps(cut))
    return str(directory)


@pytest.mark.parametrize("name,layers", CASES)
@pytest.mark.parametrize("target", ["v6e:2x2", "h100x8"])
def test_gemma_serving_step_compiles_for_the_target(target, name, layers, tmp_path):
    """The largest bucket (512 tokens, 64 sequences), the plain variant (the sampler's parts
    compile in test_compile_step.py): its arguments are the weights and KV caches split 4 ways,
    every layer's cache donated and written in place (no copy), every layer through the
    platform's attention kernel."""
    devices(target)
    tp_size = 4  # Gemma 3: 16 kv heads, 4 a device; Gemma 4: 16 local, 4 global (1 a device)
    args = ServerArgs(model_path=_model_path(name, layers, tmp_path), tp_size=tp_size,
                      max_running_requests=64, max_prefill_tokens=512)
    program, shapes, description = aot.server_step(target, args)
    whole_bytes, whole_layers, architecture = MODELS[name]
    assert architecture in description
    compiled = program.compile(*shapes[-1], PLAIN)
    weights = weight_bytes(program)
    if layers is None:
        assert abs(weights - whole_bytes) < 0.01e9, weights
    kv_bytes = sum(cache.size * cache.dtype.itemsize for cache in program.args[1])
    per_device = (weights + kv_bytes) / tp_size
    argument_bytes = compiled.memory_analysis().argument_size_in_bytes
    assert 0.95 * per_device < argument_bytes < 1.1 * per_device, description
    hlo = compiled.as_text()
    for cache in {(c.shape, c.dtype) for c in program.args[1]}:  # each layer kind's shape
        (pages, page_size, width), dtype = cache
        assert not cache_copies(hlo, (pages, page_size, width // tp_size), dtype), \
            f"a KV cache of {cache} is copied"
    num_layers = len(program.args[1])
    assert num_layers == (layers or whole_layers)
    assert hlo.splitlines()[0].count("may-alias") >= num_layers + 2, description
    # One Pallas attention kernel a layer, local and global alike (no layer falls back to XLA).
    kernel = ('custom_call_target="tpu_custom_call"' if target.startswith("v")
              else 'name = "attention_program')
    assert hlo.count(kernel) == num_layers, description
