"""The whole serving step (forward with the Pallas attention inside, sampler, penalty state) of a
real-size model, compiled for TPU v6e (2x2, tensor parallel over 4 chips) and for one H100,
without the hardware (executor/aot.py): what a server on those machines would precompile at
start-up, at the largest bucket (the q-block heuristic's biggest blocks). Weights are not read:
Llama-3.1-8B's config.json (benchmarks/configs) gives the shapes.
"""
from pathlib import Path

import pytest

from tests.compile_targets import cache_copies, devices
from xlaserve.executor import aot
from xlaserve.server_args import ServerArgs

LLAMA_8B = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.1-8b")
WEIGHT_BYTES = 16.06e9  # Llama-3.1-8B in bfloat16


@pytest.mark.parametrize("target,tp_size", [("v6e:2x2", 4), ("h100", 1)])
def test_llama_8b_serving_step_compiles_for_the_target(target, tp_size):
    devices(target)  # skips where the compile-only package is absent
    args = ServerArgs(model_path=LLAMA_8B, tp_size=tp_size, max_running_requests=64)
    program, shapes, description = aot.server_step(target, args)
    tokens, seqs, pages = shapes[-1]
    assert (tokens, seqs) == (512, 64), description  # --max-prefill-tokens, 64 requests
    compiled = program.compile(tokens, seqs, pages)

    memory = compiled.memory_analysis()
    kv_bytes = sum(cache.size * cache.dtype.itemsize for cache in program.args[1])
    per_device = (WEIGHT_BYTES + kv_bytes) / tp_size
    assert 0.95 * per_device < memory.argument_size_in_bytes < 1.1 * per_device, description
    hlo = compiled.as_text()
    # The 32 caches (and the penalty state) are donated and updated in place: no cache is copied.
    cache = program.args[1][0]
    local = (cache.shape[0], cache.shape[1], cache.shape[2] // tp_size)  # one device's shard
    assert not cache_copies(hlo, local, cache.dtype), "a KV cache is copied"
    header = hlo.splitlines()[0]  # HloModule ..., input_output_alias={ {i}: (arg, {}, may-alias), ...
    assert header.count("may-alias") >= 32 + 2, description  # caches, counts, last tokens


QWEN3_30B_A3B = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-30b-a3b")
QWEN3_30B_A3B_WEIGHT_BYTES = 61.06e9  # 30.5B parameters in bfloat16


@pytest.mark.parametrize("target,tp_size,bucket", [
    ("v6e:2x2", 4, "smallest"),
    pytest.param("v6e:2x2", 4, "largest", marks=pytest.mark.slow),
    pytest.param("h100", 1, "smallest", marks=pytest.mark.slow),
    pytest.param("h100", 1, "largest", marks=pytest.mark.slow),
])
def test_qwen3_moe_30b_serving_step_compiles_for_the_target(target, tp_size, bucket):
    """The mixture of experts at its real size: 48 layers of 128 experts, top 8, each layer's
    experts as two ragged dots (model/moe.py) inside the step, which lowers them to the target's
    grouped kernels; weights and caches sharded as loaded (~40 s a compile on a 2-core CPU, so
    only the first runs without --slow)."""
    devices(target)
    args = ServerArgs(model_path=QWEN3_30B_A3B, tp_size=tp_size, max_running_requests=64)
    program, shapes, description = aot.server_step(target, args)
    tokens, seqs, pages = shapes[0] if bucket == "smallest" else shapes[-1]
    compiled = program.compile(tokens, seqs, pages)
    kv_bytes = sum(cache.size * cache.dtype.itemsize for cache in program.args[1])
    per_device = (QWEN3_30B_A3B_WEIGHT_BYTES + kv_bytes) / tp_size
    argument_bytes = compiled.memory_analysis().argument_size_in_bytes
    assert 0.95 * per_device < argument_bytes < 1.1 * per_device, description
