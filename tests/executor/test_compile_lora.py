"""LoRA adapter slots (issue 53) in the serving step of Llama-3.1-8B compiled for one H100 and for
TPU v6e (2x2, tensor parallel over 4 chips), without the hardware (runtime/executor/aot.py): the
slot arrays go in after the weights, each device holding its share as its base weight is split
(qkv's and gate/up's b by output, o_proj's and down's a by input), and the product compiles
with the platform's kernels around it."""
import jax
import numpy as np
import pytest

from benchmarks.predict_accelerators import weight_copies
from tests.compile_targets import devices, first_layers
from xlaserve.model.lora import slot_shapes
from xlaserve.runtime.executor import aot
from xlaserve.runtime.sampling.step_needs import PLAIN
from xlaserve.server_args import ServerArgs


def _per_device_bytes(arrays) -> int:
    return int(sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in arrays))


@pytest.mark.parametrize("target,tp_size", [
    ("h100", 1),
    ("v6e:2x2", 4)])
def test_llama_8b_step_with_lora_slots_compiles_and_shards_them(target, tp_size, tmp_path):
    devices(target)  # skips where the compile-only package is absent
    model_path = first_layers("llama-3.1-8b", 2, tmp_path)
    program, shapes, description = aot.server_step(target, ServerArgs(
        model_path=model_path, tp_size=tp_size, max_running_requests=64, enable_lora=True,
        max_loras_per_batch=4, max_lora_rank=16, lora_target_modules=["all"]))
    assert "4 LoRA slots of rank 16 on 7 modules" in description
    config, _ = aot.read_config(model_path, load_format="dummy")
    weights = program.args[0]
    expected = slot_shapes(config, program.lora)
    slots = weights[-len(expected) - 1:]
    assert [tuple(a.shape) for a in slots[:-1]] == [shape for _, shape, _ in expected]
    assert slots[-1].shape == (65,)  # each request slot's adapter
    # Per device: qkv's, gate and up's b and o_proj's and down's a split tp ways, the rest whole.
    split = sum(np.prod(shape) for name, shape, _ in expected
                if name.split(".")[2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                          "o_proj", "down")
                and (name.endswith(".b") != (name.split(".")[2] in ("o_proj", "down"))))
    whole = sum(np.prod(shape) for _, shape, _ in expected) - split
    assert _per_device_bytes(slots[:-1]) == 2 * (whole + split // tp_size)
    # The plain variant: the slots are in the forward; the sampler's parts compile in
    # test_compile_step.py.
    compiled = program.compile(*shapes[0], PLAIN)
    # No weight relaid out in the step: on v6e the weights and slots are stored in the layouts
    # XLA chose, and the adapters' product is added apart from the base matmul
    # (Kernels.lora_add_apart); fused into it, qkv's weight was copied every step.
    assert not weight_copies(compiled.as_text(), weights), description
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes >= _per_device_bytes(jax.tree.leaves(program.args[0]))
