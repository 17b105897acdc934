"""The model's weights as few arguments of the jitted step.

Every argument of a jitted call costs host time on every call (PjRt's per-buffer bookkeeping:
~10 us each on a 2-core CPU), and the default model has 182 weight leaves, ~2 ms of a 27 ms
one-token step. So a leaf that is the same array as another (the layers' views of one stack of
packed weights, model/weight_types/packed.py) goes once, and on a single device the small leaves of
one shape and dtype (norm scales, biases) go as one stacked array that the step slices back: a slice
of a few KiB costs nothing next to the step. On TPU the layers' weights of one kind go stacked too
(`stack_layers`: XLA's TPU compiler charged separate weight arguments 2.4-5x their bytes, and a
stack reads in place), but for a mixture of experts' weights, which the grouped matmul's custom
call would take as a copy of its layer's slice; on CPU and GPU a big leaf stays an argument of
its own.

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


def weight_args(leaves: list, stack_small: bool, stack_layers: bool = False,
                names: list[str] | None = None) -> tuple[list[jax.Array], WeightLayout]:
    """(arguments, layout) for `leaves` (a flattened weight pytree). `stack_small`: leaves of at
    most SMALL_LEAF_BYTES of one shape and dtype go as one stacked argument (a single device).
    `stack_layers` (TPU): every group of two or more leaves of one shape, dtype and sharding goes
    as one argument stacked on a new leading axis, sharded as they were below it, so a
    model's layers take one argument per kind of weight. On a v6e, 32 [4096, 4096] bfloat16
    weights as one argument each were charged 2.62 GB by XLA (1.38 GB a chip at tp 4), stacked
    1.08 GB (0.274; the weights are 1.07 and 0.268: benchmarks/probe_stacked_weights.py); on an
    H100 both cost the same, so GPUs keep one argument each. But a mixture of experts' weights
    (`names`: the leaves' paths, "experts_" in them) stay one argument a layer: a layer's slice
    of a stack that a custom call reads (TPU's grouped matmul) is copied out whole, every layer
    and step (Qwen3-30B-A3B, v6e tp 1: 1.2 GB a layer). Arrays stacked here are deleted once
    the stack is made (the weights are not held twice): the model's own leaves are unusable
    afterwards."""
    args: list[jax.Array] = []
    sources: list[tuple[int, int] | None] = [None] * len(leaves)
    seen: dict[int, int] = {}
    groups: dict[tuple, list[int]] = {}
    uses: dict[int, int] = {}
    for leaf in leaves:
        uses[id(leaf)] = uses.get(id(leaf), 0) + 1
    for i, leaf in enumerate(leaves):
        key = (leaf.shape, np.dtype(leaf.dtype).name)
        if id(leaf) in seen:
            sources[i] = (seen[id(leaf)], -1)
        elif stack_small and leaf.size * np.dtype(leaf.dtype).itemsize <= SMALL_LEAF_BYTES:
            groups.setdefault(("small", *key), []).append(i)
        elif (stack_layers and uses[id(leaf)] == 1  # a shared array goes once, unstacked
              and isinstance(getattr(leaf, "sharding", None), NamedSharding)
              and not (names and "experts_" in names[i])):
            groups.setdefault(("layers", *key, tuple(leaf.sharding.spec)), []).append(i)
        else:
            seen[id(leaf)] = len(args)
            sources[i] = (len(args), -1)
            args.append(leaf)
    for (kind, *_), members in groups.items():
        if len(members) == 1:
            sources[members[0]] = (len(args), -1)
            args.append(leaves[members[0]])
            continue
        for row, i in enumerate(members):
            sources[i] = (len(args), row)
        group = [leaves[i] for i in members]
        args.append(_stack_small(group) if kind == "small" else _stack_layers(group))
    return args, WeightLayout(tuple(sources))


def leaf_names(tree) -> list[str]:
    """The paths of `tree`'s leaves, in jax.tree.flatten's order (weight_args' `names`)."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree.flatten_with_path(tree)[0]]


def _stack_small(leaves: list):
    """jnp.stack, or the stack's ShapeDtypeStruct for abstract leaves (runtime/executor/aot.py compiles
    the step without arrays; small leaves are stacked on a single device only, so replicated)."""
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding and NamedSharding(first.sharding.mesh, P())
        return jax.ShapeDtypeStruct((len(leaves),) + first.shape, first.dtype, sharding=sharding)
    return jnp.stack(leaves)


def _stack_layers(leaves: list):
    """The leaves stacked on a new leading axis, each device holding its part of every leaf
    (their sharding below that axis); a ShapeDtypeStruct for abstract leaves. The stacked arrays
    are deleted once the stack is made."""
    first = leaves[0]
    sharding = NamedSharding(first.sharding.mesh, P(None, *first.sharding.spec))
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves),) + first.shape, first.dtype, sharding=sharding)
    stacked = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*leaves)
    for leaf in leaves:
        leaf.delete()
    return stacked


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
