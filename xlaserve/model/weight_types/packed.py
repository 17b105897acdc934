"""Weights in the panel layout of the CPU's native GEMM (xlaserve/native/gemm_cpu.py).

On a single CPU device every matmul weight is packed once, when the ModelRunner is built: a
`PackedMatrix` replaces the array as the value of its nnx Variable, and `layers.linear` sends
it to `Kernels.packed_matmul`; the experts' weights of a mixture-of-experts layer become a
`PackedExperts` (each expert's matrix packed), which `moe.run_experts` sends to
`Kernels.packed_grouped_matmul`. The weight is not kept in its own layout as well (that would
double the model's memory); a tied embedding is looked up from its panels (`embed`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
from flax import nnx

from xlaserve.model.weight_types.int8 import Int8Matrix
from xlaserve.model.weight_types.quantized_rows import (QuantizedLinear, embed_rows, int8_rows,
                                                        stack_layers)
from xlaserve.model.weight_types.whole_weight import ReadWhole
from xlaserve.native import gemm_cpu, quantized_gemm_cpu

# The leaves that are matmul weights, with how many of their leading axes are contracted.
MATMUL_WEIGHTS = {"qkv": 1, "o_proj": 2, "gate_up": 1, "down": 1, "lm_head": 1, "up": 1,
                  # a hybrid model's linear layers (model/linear_attention.py) and output gate
                  "in_proj_qkv": 1, "in_proj_z": 1, "in_proj_ba": 1, "out_proj": 2,
                  "output_gate": 1,
                  "in_proj_xbc": 1, "in_proj_dt": 1}  # Nemotron-H's Mamba-2 (model/mamba2.py)
# The experts' weights [E, K, N...] (model/moe.py): one contracted axis after the experts'.
EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")


@dataclasses.dataclass
class _Panels(ReadWhole):
    """What both packed kinds hold: panels, and how to read them."""

    panels: jax.Array
    output_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # N, unflattened
    layer: int = dataclasses.field(default=0, metadata=dict(static=True))  # which of a stack
    # bfloat16 panels in k-pairs, multiplied with VDPBF16PS (native/gemm_cpu.py)
    bf16_pairs: bool = dataclasses.field(default=False, metadata=dict(static=True))


    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def columns(self) -> int:
        return math.prod(self.output_axes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedMatrix(_Panels):
    """A matmul weight: panels [ceil(N/P), K, P], or a stack of every layer's [L, ...]."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedExperts(_Panels):
    """The experts' weight [E, K, N...] as each expert's panels [E, ceil(N/P), K, P], or a stack of
    every mixture-of-experts layer's [L, E, ...]."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape in its own layout: [E, K, N...]."""
        return (self.panels.shape[-4], self.panels.shape[-2], *self.output_axes)


def output_axes(shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The output axes of x [T, K] @ weight: what follows the leading axes that multiply to K."""
    for i in range(1, len(shape)):
        if math.prod(shape[:i]) == k:
            return tuple(shape[i:])
    raise ValueError(f"no leading axes of a weight of shape {shape} multiply to {k}")


def pack(weight: jax.Array, contracted_axes: int = 1, transposed: bool = False) -> PackedMatrix:
    """`weight` [K..., N...] (its first `contracted_axes` axes are contracted), or [N, K] used as
    x @ weight.T with `transposed`, in panels."""
    if transposed:
        pairs = gemm_cpu.uses_bf16_pairs(weight.dtype, weight.shape[1])
        return PackedMatrix(gemm_cpu.pack_rows(weight, pairs), (weight.shape[0],), bf16_pairs=pairs)
    axes = tuple(weight.shape[contracted_axes:])
    matrix = weight.reshape(-1, math.prod(axes))
    pairs = gemm_cpu.uses_bf16_pairs(weight.dtype, matrix.shape[0])
    return PackedMatrix(gemm_cpu.pack_columns(matrix, pairs), axes, bf16_pairs=pairs)


def pack_experts(weight: jax.Array) -> PackedExperts:
    """The experts' `weight` [E, K, N...] in panels, expert by expert."""
    experts, k = weight.shape[:2]
    pairs = gemm_cpu.uses_bf16_pairs(weight.dtype, k)
    return PackedExperts(gemm_cpu.pack_groups(weight.reshape(experts, k, -1), pairs),
                         tuple(weight.shape[2:]), bf16_pairs=pairs)


def _pack_leaf(name: str, weight: jax.Array) -> PackedMatrix | PackedExperts:
    if name in EXPERT_WEIGHTS:
        return pack_experts(weight)
    return pack(weight, MATMUL_WEIGHTS[name])


def pack_model(model: nnx.Module, tie_word_embeddings: bool, int8_as_rows: bool = False,
               int8_activations: str = "float32") -> None:
    """Packs `model`'s matmul and experts' weights in place. The layers' weights of one kind
    (every layer's qkv, ...) become one stack, each layer's Variable a view of it (one stack per
    shape where a model's layers differ: Gemma 4's full layers' attention): a step then takes 4
    weight arrays for all layers instead of 4 per layer, and each argument of a jitted call costs host time (with
    runtime/executor/weight_args.py, 182 weight arguments became 6 and the host dispatch of a one-token
    step went from 3.2 to 2.1 ms on a 2-core CPU). A model already packed is left as it is.
    `int8_as_rows`: `--quantization int8` weights become "i8_row" QuantizedLinears for the native
    quantized GEMM (stacked the same way), else XLA's dot multiplies them; `int8_activations`
    their QuantizedRows.activations ("q8": W8A8, quantized_rows.int8_rows)."""
    _, state = nnx.split(model)
    values, stacks = {}, {}
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        name = str(path[-1])
        packs = name in MATMUL_WEIGHTS or name in EXPERT_WEIGHTS
        if isinstance(value, Int8Matrix) and int8_as_rows:
            value = int8_rows(value, quantized_gemm_cpu.i8_rows, int8_activations)
        elif isinstance(value, (_Panels, Int8Matrix, QuantizedLinear)):
            # quantized weights are not packed in float panels: quantized rows have their own
            # GEMM, and int8 weights without it are XLA's (layers.linear)
            pass
        elif packs and path[0] == "layers":  # one stack per kind and shape (layers may differ)
            stacks.setdefault((path[2:], tuple(value.shape)), []).append((path, value))
            continue
        elif packs:
            value = _pack_leaf(name, value)
        elif name == "embedding" and tie_word_embeddings:
            value = pack(value, transposed=True)
        values[path] = value
    for members in stacks.values():
        name = str(members[0][0][-1])
        # What packing one layer's weight gives, but its panels: axes, k-pairs (no work done)
        packed = jax.eval_shape(functools.partial(_pack_leaf, name), members[0][1])
        stack = _packed_stack([value for _, value in members], name)
        for layer, (path, _) in enumerate(members):
            values[path] = dataclasses.replace(packed, panels=stack, layer=layer)
    nnx.update(model, nnx.from_flat_state(stack_layers(values)))


@functools.partial(jax.jit, static_argnums=1)
def _packed_stack(weights: list[jax.Array], name: str) -> jax.Array:
    """Every layer's weight of one kind packed, as one stack. One program, where packing op by op
    (337 small ops for the default model) took 1.3 s of a start, 2.9 s beside the KV pool's
    zeroing; compiled and run: 0.76 s (2-core Zen 4)."""
    return jax.numpy.stack([_pack_leaf(name, w).panels for w in weights])


def embed(embedding, ids: jax.Array) -> jax.Array:
    """embedding[ids] for an embedding array, a packed tied one or a quantized one (only the rows
    looked up are dequantized)."""
    if isinstance(embedding, QuantizedLinear):
        return embed_rows(embedding, ids, quantized_gemm_cpu.quantized_rows)
    if isinstance(embedding, PackedMatrix):
        return gemm_cpu.packed_rows(embedding.panels, ids, embedding.bf16_pairs)
    return embedding[ids]
