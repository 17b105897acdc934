"""`--quantization mxfp4`: a gpt-oss checkpoint's MXFP4 experts kept as stored, four bits a weight
and one E8M0 scale a group of 32, on the GPU (model/weight_types/mxfp4_experts.py's Mxfp4Experts,
multiplied by pallas_kernels/grouped_matmul_mxfp4.py), where the loader otherwise decodes them to
bfloat16 (weights/formats/mxfp4.py). A quarter of the experts' bytes: gpt-oss-120b's decoded experts
are 234 GB (several GPUs), kept ~61 GB (one H100 or H200).

The bytes are the file's own. gate_up's rows are gate's and up's output features interleaved
(gate 2i, up 2i + 1, as param_layout._deinterleave reads the decoded matrix); kept, they are
split into [E, 2, I, ...] (gate's I rows, then up's), our float layout's order. down is kept as
stored, [E, H, I/32, 16].

Refused in one line where the kernel would not give the decoded experts' values: an E8M0 scale
byte of 255 (NaN), one whose values overflow bfloat16, and one under 2 (values under float32's
normal range, which the kernel's bit-level scale flushes to zero where the decoding at load keeps
them): gpt-oss's scales lie around 2**-8 to 2**3.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

import jax
from flax import nnx

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.weight_types.mxfp4_experts import MXFP4_KEPT, Mxfp4Experts, mxfp4_mesh_problem
from xlaserve.weights.formats.mxfp4 import GROUP, Mxfp4Error, first_overflowing_scale
from xlaserve.weights.formats.tensor_source import TensorSource

SMALLEST_SCALE = 2  # 2**-125: the smallest value, 0.5 of it, is float32's smallest normal


def check_model(config: ModelConfig, mesh, where: str | None) -> None:
    """ValueError in one line unless `config` is gpt-oss's and `mesh` takes its MXFP4 experts
    (`where`: the checkpoint, None for dummy weights)."""
    if config.architecture != "GptOssForCausalLM":
        raise ValueError(f"--quantization mxfp4 keeps gpt-oss's MXFP4 experts; "
                         f"{where or 'this config'} is {config.architecture}")
    problem = mxfp4_mesh_problem(config.hidden_size, config.moe_intermediate_size, mesh)
    if problem is not None:
        raise ValueError(f"--quantization mxfp4: {problem}")


def kept_bytes(model) -> int:
    """Bytes of the model's weights kept in MXFP4."""
    _, state = nnx.split(model)
    values = [variable.get_value() for _, variable in nnx.to_flat_state(state)]
    return sum(leaf.nbytes for value in values if isinstance(value, Mxfp4Experts)
               for leaf in jax.tree.leaves(value))


def kept_paths(config: ModelConfig) -> frozenset[tuple]:
    """The parameters kept in MXFP4 (param_layout.convert skips them)."""
    return frozenset(("layers", i, "mlp", name) for i in range(config.num_layers)
                     for name in MXFP4_KEPT)


def kept_experts(config: ModelConfig, source: TensorSource) -> Iterator[tuple[tuple, Mxfp4Experts]]:
    """`(parameter path, Mxfp4Experts of numpy arrays)` of every layer's gate_up and down, read
    one layer at a time."""
    experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        blocks, scales = _packed(source, prefix + "gate_up_proj", (experts, 2 * inter, hidden))
        # Output rows 2i (gate) and 2i + 1 (up) -> [E, 2, I, ...].
        yield ("layers", i, "mlp", "experts_gate_up"), Mxfp4Experts(
            np.ascontiguousarray(blocks.reshape(experts, inter, 2, *blocks.shape[2:])
                                 .swapaxes(1, 2)),
            np.ascontiguousarray(scales.reshape(experts, inter, 2, -1).swapaxes(1, 2)))
        blocks, scales = _packed(source, prefix + "down_proj", (experts, hidden, inter))
        yield ("layers", i, "mlp", "experts_down"), Mxfp4Experts(np.asarray(blocks),
                                                                 np.asarray(scales))


def _packed(source: TensorSource, name: str, shape: tuple[int, int, int]):
    """`<name>_blocks` uint8 [E, out, in/32, 16] and `<name>_scales` uint8 [E, out, in/32] of the
    matrix `name` of `shape` [E, out, in], checked (module docstring)."""
    experts, rows, cols = shape
    if cols % GROUP:
        raise Mxfp4Error(f"{name}: {cols} input features is not a multiple of the MXFP4 group "
                         f"of {GROUP}")
    arrays = []
    for suffix, expected in (("_blocks", (experts, rows, cols // GROUP, GROUP // 2)),
                             ("_scales", (experts, rows, cols // GROUP))):
        if name + suffix not in source.names():
            raise Mxfp4Error(f"--quantization mxfp4: checkpoint has no {name + suffix!r} "
                             f"(expected shape {list(expected)})")
        array = source.get(name + suffix)
        if tuple(array.shape) != expected or array.dtype != np.uint8:
            raise Mxfp4Error(f"tensor {name + suffix!r} is {array.dtype} {list(array.shape)}, "
                             f"expected uint8 {list(expected)} from the config")
        arrays.append(array)
    scales = np.asarray(arrays[1])
    low, high = int(scales.min(initial=255)), int(scales.max(initial=0))
    if low < SMALLEST_SCALE or high >= first_overflowing_scale("bfloat16"):
        byte = low if low < SMALLEST_SCALE else high
        raise Mxfp4Error(f"{name}: MXFP4 scale byte {byte} (2**{byte - 127}) is outside what the "
                         f"GPU kernel decodes exactly ({SMALLEST_SCALE} to "
                         f"{first_overflowing_scale('bfloat16') - 1}); serve without "
                         f"--quantization mxfp4")
    return arrays[0], scales
