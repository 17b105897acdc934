"""`--quantization int8` (model/weight_types/int8.py) in the serving step of Llama-3.1-8B compiled
for one H100 and for TPU v6e (2x2, tensor parallel over 4 chips), without the hardware
(runtime/executor/aot.py): the weights go in as int8 with float32 scales per output column (the
embedding and LM head stay bfloat16), and every int8 weight is converted to bfloat16 inside the
matmul's own fusion, so no bfloat16 copy of a weight is made.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.compile_targets import devices, first_layers
from xlaserve.runtime.executor import aot
from xlaserve.runtime.sampling.step_needs import PLAIN
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.server_args import ServerArgs


def int8_weight_bytes(c: ModelConfig) -> int:
    """Llama-3.1-8B's weights with --quantization int8, from its shapes: the embedding, LM head
    and norms in bfloat16, each layer's qkv, o_proj, gate_up and down one byte a weight and a
    float32 scale a column."""
    q, kv, h, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    bfloat16 = 2 * (2 * c.vocab_size * h + (2 * c.num_layers + 1) * h)
    int8 = h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h
    scales = 4 * ((q + 2 * kv) + h + 2 * inter + h)
    return bfloat16 + c.num_layers * (int8 + scales)


def unfused_int8_converts(hlo: str) -> list[str]:
    """Converts of an int8 array to another type in a computation without a dot: a dequantized
    copy of a weight written to memory instead of read inside the matmul."""
    found = []
    for block in re.split(r"\n(?=\S)", hlo):  # computations start at column 0
        types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", block))
        has_dot = re.search(r"\b(dot|convolution)\(", block) is not None
        for line in block.splitlines():
            convert = re.search(r"= (\w+)\[[^\]]*\]\S* convert\((%[\w.\-]+)\)", line)
            if convert and types.get(convert.group(2)) == "s8" and not has_dot:
                found.append(line.strip()[:200])
    return found


def test_unfused_int8_converts_finds_a_weight_dequantized_outside_the_matmul():
    """XLA's CPU backend converts the int8 operand in a fusion of its own, then multiplies."""
    step = jax.jit(lambda x, w: x @ w.astype(jnp.float32)).lower(
        jax.ShapeDtypeStruct((8, 256), jnp.float32), jax.ShapeDtypeStruct((256, 512), jnp.int8))
    found = unfused_int8_converts(step.compile().as_text())
    assert len(found) == 1 and "f32[256,512]" in found[0]


def _compiled(model_path, target, tp_size, quantization):
    """The smallest decode bucket's plain variant (greedy rows): the weights are read in the
    forward; the sampler's parts (the logits only) compile in test_compile_step.py."""
    program, shapes, description = aot.server_step(target, ServerArgs(
        model_path=model_path, tp_size=tp_size, max_running_requests=64,
        quantization=quantization))
    return program, program.compile(*shapes[0], PLAIN), description


# Bytes the weights' chosen layouts may pad the arguments by, per device (2 KiB seen).
LAYOUT_PADDING = 1 << 16


def _per_device_bytes(weights) -> int:
    return int(sum(np.prod(w.sharding.shard_shape(w.shape)) * w.dtype.itemsize for w in weights))


# CI compiles the first 2 layers (compile_targets.first_layers); --slow the whole model.
@pytest.mark.parametrize("layers", [2, pytest.param(None, marks=pytest.mark.slow)],
                         ids=["2-layers", "whole"])
@pytest.mark.parametrize("target,tp_size", [
    ("h100", 1), ("v6e:2x2", 4)])
def test_llama_8b_int8_step_takes_int8_weights_and_makes_no_bfloat16_copy(target, tp_size,
                                                                          layers, tmp_path):
    devices(target)  # skips where the compile-only package is absent
    model_path = first_layers("llama-3.1-8b", layers, tmp_path)
    program, compiled, description = _compiled(model_path, target, tp_size, "int8")
    weights = jax.tree.leaves(program.args[0])
    config, _ = aot.read_config(model_path, load_format="dummy")
    assert config.num_layers == (layers or 32)
    assert sum(w.size * w.dtype.itemsize for w in weights) == int8_weight_bytes(config)
    # 4 int8 matrices a layer: on TPU each kind is one argument stacked over the layers
    # (weight_args.py, stack_layers), on a GPU one argument each.
    per_argument = config.num_layers if target.startswith("v") else 1
    assert sum(per_argument for w in weights if w.dtype == np.int8) == 4 * config.num_layers
    hlo = compiled.as_text()
    assert not unfused_int8_converts(hlo), unfused_int8_converts(hlo)[:3]

    float_program, float_step, _ = _compiled(model_path, target, tp_size, None)
    ours, theirs = compiled.memory_analysis(), float_step.memory_analysis()
    # Per device, the arguments shrink by the weights' bytes saved (the scales of o_proj and
    # down, [hidden], are replicated like the layers' outputs), to within the padding of the
    # layouts XLA chose for the weights (weight_args.py): v6e tp 4 tiles one layer's qkv scales,
    # f32[2, 6, 128], in 8 x 128 tiles, 2 KiB more ...
    saved = _per_device_bytes(jax.tree.leaves(float_program.args[0])) - _per_device_bytes(weights)
    shrunk = theirs.argument_size_in_bytes - ours.argument_size_in_bytes
    assert abs(shrunk - saved) <= LAYOUT_PADDING, (shrunk, saved, description)
    # ... and the temporaries grow by less than any int8 weight would take in bfloat16: no
    # bfloat16 weight is materialized. (Without the sampler's lax.conds, whose branches held the
    # bf16 step's largest temporaries (issue 33 item 2), the int8 step on v6e tp 4 keeps 7.1 MB
    # more, at 8 and at 64 rows alike, in the variant with every sampler part; the smallest
    # bf16 weight copy, o_proj's, is 8.4 MB. Both steps here are the plain variant.)
    smallest_copy = min(2 * _per_device_bytes([w]) for w in weights if w.dtype == np.int8)
    assert ours.temp_size_in_bytes < theirs.temp_size_in_bytes + smallest_copy, description
