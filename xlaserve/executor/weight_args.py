"""The model's weights as few arguments of the jitted step.

Every argument of a jitted call costs host time on every call (PjRt's per-buffer bookkeeping:
~10 us each on a 2-core CPU), and the default model has 182 weight leaves, ~2 ms of a 27 ms
one-token step. So a leaf that is the same array as another (the layers' views of one stack of
packed weights, model/packed.py) goes once, and on a single device the small leaves of one shape
and dtype (norm scales, biases) go as one stacked array that the step slices back: a slice of a
few KiB costs nothing next to the step (of a weight it would be a copy, so big leaves are never
stacked here).

The weights' layouts (how each is laid out in memory; `weight_formats` below) are XLA's choice on
TPU, made once and kept by every program, so that no step relays a weight out for the matrix
unit (ModelRunner.precompile, aot.StepProgram.compile; on an H100 XLA chooses the defaults).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SMALL_LEAF_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    # For each leaf: (argument index, row of that stacked argument, or -1 for the argument itself)
    sources: tuple[tuple[int, int], ...]


def weight_args(leaves: list, stack_small: bool) -> tuple[list[jax.Array], WeightLayout]:
    """(arguments, layout) for `leaves` (a flattened weight pytree)."""
    args: list[jax.Array] = []
    sources: list[tuple[int, int] | None] = [None] * len(leaves)
    seen: dict[int, int] = {}
    small: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if id(leaf) in seen:
            sources[i] = (seen[id(leaf)], -1)
        elif stack_small and leaf.size * np.dtype(leaf.dtype).itemsize <= SMALL_LEAF_BYTES:
            small.setdefault((leaf.shape, np.dtype(leaf.dtype).name), []).append(i)
        else:
            seen[id(leaf)] = len(args)
            sources[i] = (len(args), -1)
            args.append(leaf)
    for members in small.values():
        if len(members) == 1:
            sources[members[0]] = (len(args), -1)
            args.append(leaves[members[0]])
            continue
        for row, i in enumerate(members):
            sources[i] = (len(args), row)
        args.append(_stack([leaves[i] for i in members]))
    return args, WeightLayout(tuple(sources))


def _stack(leaves: list):
    """jnp.stack, or the stack's ShapeDtypeStruct for abstract leaves (executor/aot.py compiles
    the step without arrays; stacking only happens on a single device, so it is replicated)."""
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding and NamedSharding(first.sharding.mesh, P())
        return jax.ShapeDtypeStruct((len(leaves),) + first.shape, first.dtype, sharding=sharding)
    return jnp.stack(leaves)


def leaves_from_args(args: list, layout: WeightLayout) -> list:
    """The leaves again, inside the jitted step."""
    return [args[index] if row < 0 else args[index][row] for index, row in layout.sources]


def auto_formats(args: list) -> list[Format]:
    """Each weight argument's sharding with its layout left to XLA (Layout.AUTO): make_step's
    `weight_formats` for the compile that chooses the layouts. With the default layouts the
    TPU v6e step (Llama-3.1-8B, tp 4) relaid each layer's qkv and gate_up weights out for the
    MXU every step, 64 copies inside the matmuls' fusions (XLA's cost analysis charges them no
    HBM bytes: the predicted step time is the same; their cost on the chip is unmeasured)."""
    return [Format(Layout.AUTO, arg.sharding) for arg in args]


def weight_formats(compiled) -> list[Format]:
    """The layouts and shardings a compiled step takes its weight arguments (its first
    argument) in."""
    return list(compiled.input_formats[0][0])


def abstract_args(args: list, formats: list[Format] | None = None) -> list:
    """ShapeDtypeStructs of the weight arguments, with their shardings, or with `formats` (the
    step is then lowered for weights stored in those layouts)."""
    return [jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=arg.sharding if f is None else f)
            for arg, f in zip(args, formats or [None] * len(args), strict=True)]


def stored_in(args: list, formats: list[Format]) -> list[jax.Array]:
    """The weight arguments stored in `formats`: each one whose layout differs is copied and its
    old buffer freed before the next is copied, so the weights never take twice their memory.
    The freed arrays are the model's own (ModelRunner's `loaded.model`), which no longer works."""
    stored = []
    for arg, target in zip(args, formats, strict=True):
        if arg.format.layout != target.layout:
            copy = jax.device_put(arg, target).block_until_ready()
            arg.delete()
            arg = copy
        stored.append(arg)
    return stored
