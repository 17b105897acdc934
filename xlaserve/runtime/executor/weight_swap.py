"""The served weights replaced, released and resumed in place (RL rollouts:
runtime/engine/weight_updates.py decides when; this file does it to a ModelRunner).

The step takes the model's weights as a flat list of arguments (weight_args.py). New weights
become arguments of the same shapes, dtypes, shardings and layouts, and take the old ones'
places in that list, so every program compiled for the old ones serves the new ones: no
compile. The list is changed in place: the LoRA slots (lora_slots.py, the list's tail) and a
draft head's steps read it. Released weights leave their arguments' specs behind (and, with
--enable-weights-cpu-backup, their values on the host), from which `resume` re-makes them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.model.weight_types.packed import pack_model
from xlaserve.model.weight_types.quantized_rows import check_quantized_rows, native_gemm_available
from xlaserve.runtime.executor.weight_args import WeightLayout, leaf_names, stored_in, weight_args


def dotted_names(tree) -> list[str]:
    """The paths of `tree`'s leaves (an NNX state), in jax.tree.flatten's order, as dotted
    names: "layers.0.attn.qkv.panels" (what get_weights_by_name takes and errors name)."""
    def part(key) -> str:
        for field in ("key", "idx", "name"):
            if hasattr(key, field):
                return str(getattr(key, field))
        return str(key)
    return [".".join(p for p in map(part, path) if p != "value")
            for path, _ in jax.tree.flatten_with_path(tree)[0]]


# The most values get_weights_by_name reads back (a client's request; ~10 MB of JSON).
MAX_VALUES_READ = 1 << 20


class WeightMismatch(ValueError):
    """New weights that are not the served model's shapes: nothing was replaced."""


def prepare_model(model, config, kernels, quantized_activations: str) -> None:
    """A loaded model's weights made what the runner's kernels multiply: packed matrices
    (model/weight_types/packed.py) and int8 rows checked."""
    if kernels.packed_matmul is not None:
        # An embedding server's model has no LM head: its tied embedding stays as it is.
        pack_model(model, config.tie_word_embeddings and config.lm_head,
                   int8_as_rows=native_gemm_available(), int8_activations=quantized_activations)
    check_quantized_rows(model, kernels)


class WeightSwap:
    def __init__(self, runner, num_args: int, leaf_names: list[str], layout: WeightLayout,
                 quantized_activations: str):
        """`num_args`: the model's leading weight arguments of `runner` (LoRA slots follow);
        `leaf_names`: the model state's leaves' paths, which `layout` maps to arguments."""
        self._runner = runner
        self._count = num_args
        self._leaf_names = leaf_names
        self._layout = layout
        # An argument's name in errors: its first leaf's path.
        self._names = [""] * num_args
        for name, (index, _) in reversed(list(zip(leaf_names, layout.sources))):
            self._names[index] = name
        self._activations = quantized_activations
        self._released: list | None = None  # the arguments' (spec, format) while released
        self._host: list | None = None  # their values, with a backup

    @property
    def released(self) -> bool:
        return self._released is not None

    def _args(self) -> list:
        return self._runner._weight_args

    def _specs(self) -> list:
        if self._released is not None:
            return self._released
        return [(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), a.format)
                for a in self._args()[:self._count]]

    def arguments_of(self, model) -> list[jax.Array]:
        """`model`'s weights (a freshly loaded model of the served config, on the serving
        mesh) as the step's arguments, in the served arguments' shardings and layouts.
        WeightMismatch names the first that differs in shape or dtype (the model is then
        unusable, its arrays deleted)."""
        runner = self._runner
        prepare_model(model, runner.config, runner.kernels, self._activations)
        _, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        if treedef != runner.program_parts[1]:
            raise WeightMismatch(_first_difference(dotted_names(state), self._leaf_names))
        platform = runner.mesh.devices.flat[0].platform
        args, _ = weight_args(leaves, stack_small=runner.mesh.size == 1,
                              stack_layers=platform == "tpu", names=leaf_names(state))
        del leaves, state
        specs = self._specs()
        for i, (arg, (spec, _)) in enumerate(zip(args, specs, strict=True)):
            if arg.shape != spec.shape or arg.dtype != spec.dtype:
                for a in args:
                    a.delete()
                raise WeightMismatch(
                    f"{self._names[i]}: the new weight is {np.dtype(arg.dtype).name}"
                    f"{list(arg.shape)}, the served one {np.dtype(spec.dtype).name}"
                    f"{list(spec.shape)}")
        # The served layouts (TPU's, chosen at start-up); the shardings are the served ones
        # already: the new model was placed on the serving mesh by the same partition specs.
        return stored_in(args, [target for _, target in specs])

    def replace(self, new_args: list[jax.Array]) -> None:
        """Serve `new_args` (`arguments_of`'s), freeing the old ones. Between steps, on the
        engine loop: the last step dispatched is waited for first (it may still read them)."""
        runner, args = self._runner, self._args()
        if runner.kv_caches_held():
            jax.block_until_ready(runner.kv_caches)
        for i, new in enumerate(new_args):
            if args[i] is not None:
                args[i].delete()
            args[i] = new
        self._released = self._host = None

    def release(self, backup: bool) -> None:
        """Frees the weights' device memory, keeping their specs (and with `backup` their
        values, on the host) for `resume`."""
        if self._released is not None:
            return
        runner, args = self._runner, self._args()
        if runner.kv_caches_held():
            jax.block_until_ready(runner.kv_caches)
        specs = self._specs()
        self._host = [np.asarray(a) for a in args[:self._count]] if backup else None
        for i in range(self._count):
            args[i].delete()
            args[i] = None
        self._released = specs

    def resume(self) -> bool:
        """Re-makes released weights on the devices: their values from the host backup, else
        zeros (an update must follow). Returns whether they hold the served values."""
        if self._released is None:
            return True
        args, restored = self._args(), self._host is not None
        for i, (spec, target) in enumerate(self._released):
            if restored:
                args[i] = jax.device_put(self._host[i], target)
            else:
                zeros = jnp.zeros(spec.shape, spec.dtype, device=spec.sharding)
                args[i] = zeros if zeros.format == target else jax.device_put(zeros, target)
        self._released = self._host = None
        return restored

    def named(self, name: str, rows: int) -> np.ndarray:
        """The first `rows` rows of the served weight at leaf path `name` (`leaf_names`'
        form), on the host, as the step takes it (packed, quantized); KeyError for another
        name or released weights."""
        if name not in self._leaf_names or self._released is not None:
            raise KeyError(name)
        index, row = self._layout.sources[self._leaf_names.index(name)]
        arg = self._args()[index]
        part = (arg if row < 0 else arg[row])[:rows]
        if part.size > MAX_VALUES_READ:
            raise ValueError(f"{name}: {rows} rows are {part.size} values, over "
                             f"{MAX_VALUES_READ}: ask for fewer (truncate_size)")
        return np.asarray(part)

    def leaf_names(self) -> list[str]:
        return list(self._leaf_names)


def _first_difference(new: list[str], served: list[str]) -> str:
    """What a state of another structure lacks or adds, in one line."""
    missing = sorted(set(served) - set(new))
    extra = sorted(set(new) - set(served))
    if missing:
        return f"the new model lacks {missing[0]} ({len(missing)} served parameters missing)"
    if extra:
        return f"the new model has {extra[0]}, which the served one does not"
    return "the new model's parameters are arranged differently from the served one's"
