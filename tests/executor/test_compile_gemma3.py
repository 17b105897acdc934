"""Gemma 3's serving step at gemma-3-27b's text shapes (benchmarks/configs/gemma-3-27b-text)
compiled for TPU v6e and H100 at tp 4 without the hardware (runtime/executor/aot.py): local
sliding-window layers and global ones, each with its own RoPE table, through the platform's Pallas
attention (Mosaic, Triton). CI compiles one local and one global layer; the whole 62 layers run
under --slow (the figures in docs/tpu-gpu.md)."""
import json

import pytest

from tests.compile_targets import CONFIGS, cache_copies, devices, weight_bytes
from xlaserve.runtime.executor import aot
from xlaserve.runtime.sampling.step_needs import PLAIN
from xlaserve.server_args import ServerArgs

WEIGHT_BYTES = 54.02e9  # 27.01B parameters (the text decoder) in bfloat16
LAYERS = [2, pytest.param(None, marks=pytest.mark.slow)]


def _model_path(layers: int | None, directory) -> str:
    """The config, or its first layer of each kind: layer_types written out (the config has
    only sliding_window_pattern 6, whose first 2 layers are both local)."""
    if layers is None:
        return str(CONFIGS / "gemma-3-27b-text")
    whole = json.loads((CONFIGS / "gemma-3-27b-text" / "config.json").read_text())
    cut = {**whole, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    (directory / "config.json").write_text(json.dumps(cut))
    return str(directory)


@pytest.mark.parametrize("layers", LAYERS, ids=["local-and-global", "whole"])
@pytest.mark.parametrize("target", ["v6e:2x2", "h100x8"])
def test_gemma3_27b_serving_step_compiles_for_the_target(target, layers, tmp_path):
    """The largest bucket (512 tokens, 64 sequences), the plain variant (the sampler's parts
    compile in test_compile_step.py): its arguments are the weights and KV caches split 4 ways,
    every layer's cache donated and written in place (no copy), every layer through the
    platform's attention kernel."""
    devices(target)
    tp_size = 4  # 16 kv heads: 4 a device
    args = ServerArgs(model_path=_model_path(layers, tmp_path), tp_size=tp_size,
                      max_running_requests=64, max_prefill_tokens=512)
    program, shapes, description = aot.server_step(target, args)
    assert "Gemma3ForCausalLM" in description
    compiled = program.compile(*shapes[-1], PLAIN)
    weights = weight_bytes(program)
    if layers is None:
        assert abs(weights - WEIGHT_BYTES) < 0.01e9, weights
    kv_bytes = sum(cache.size * cache.dtype.itemsize for cache in program.args[1])
    per_device = (weights + kv_bytes) / tp_size
    argument_bytes = compiled.memory_analysis().argument_size_in_bytes
    assert 0.95 * per_device < argument_bytes < 1.1 * per_device, description
    hlo = compiled.as_text()
    cache = program.args[1][0]
    local = (cache.shape[0], cache.shape[1], cache.shape[2] // tp_size)
    assert not cache_copies(hlo, local, cache.dtype), "a KV cache is copied"
    num_layers = len(program.args[1])
    assert num_layers == (layers or 62)
    assert hlo.splitlines()[0].count("may-alias") >= num_layers + 2, description
    # One Pallas attention kernel a layer, local and global alike (no layer falls back to XLA).
    kernel = ('custom_call_target="tpu_custom_call"' if target.startswith("v")
              else 'name = "attention_program')
    assert hlo.count(kernel) == num_layers, description
