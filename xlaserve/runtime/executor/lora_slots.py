"""The LoRA adapter slots on the device (issue 53; the product is model/lora.py).

The slot arrays (`model/lora.slot_shapes`) and `slot_adapters` (each request slot's adapter: 0
none, s + 1 adapter slot s) ride at the end of the step's weight arguments
(`ModelRunner._weight_args`), so every program, precompiled or compiled ahead of time, takes
them like weights. Loading an adapter writes its slot (`write`: one program over every slot
array, the slot a traced index, compiled at start-up, the arrays donated and updated in place);
unloading zeroes it. Same shapes, same shardings: no step compiles again.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.server_args import DEFAULT_MAX_RANK, TARGET_MODULES, target_modules_of
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.lora import LoraSpec, module_shapes, slot_shapes
from xlaserve.native import gemm_cpu
from xlaserve.runtime.executor.step_program import LoraArgs
from xlaserve.weights.lora_adapter import LoraAdapter, LoraAdapterError


def slots_for(args, adapters=()) -> LoraSpec:
    """The slots a server with ServerArgs `args` makes for its start-up `adapters`
    (weights/lora_adapter.LoraAdapter): --max-lora-rank, or the adapters' largest rank (16
    without any); --lora-target-modules, or the modules they target (all seven without any)."""
    rank = args.max_lora_rank or max([a.rank for a in adapters], default=DEFAULT_MAX_RANK)
    targeted = {m for a in adapters for m in a.target_modules}
    targets = (target_modules_of(args.lora_target_modules)
               or tuple(m for m in TARGET_MODULES if m in targeted) or TARGET_MODULES)
    return LoraSpec(args.max_loras_per_batch, rank, targets)


def abstract_slot_args(spec: LoraSpec, config: ModelConfig, dtype, mesh,
                       num_request_slots: int) -> list[jax.ShapeDtypeStruct]:
    """The slot arrays and slot_adapters as ShapeDtypeStructs with their shardings: what a step
    compiled for hardware that is not here takes (runtime/executor/aot.py)."""
    return [*(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, part))
              for _, shape, part in slot_shapes(config, spec)),
            jax.ShapeDtypeStruct((num_request_slots,), jnp.int32,
                                 sharding=NamedSharding(mesh, P()))]


def lora_slots_for(spec: LoraSpec | None, kernels, config: ModelConfig, dtype, mesh,
                   num_request_slots: int, num_weight_args: int) -> "LoraSlots | NoLoraSlots":
    """A runner's LoRA slots (`spec`: their shapes; None: NoLoraSlots), after its
    `num_weight_args` weight arguments. With the native GEMM (a single CPU device), the grouped
    form: each row multiplies its own adapter's matrices alone (model/lora.py;
    docs/performance.md has the figures)."""
    if spec is None:
        return NoLoraSlots()
    if (kernels.packed_grouped_matmul is not None
            and np.dtype(dtype).name in ("float32", "bfloat16")):  # the GEMM's panels
        spec = dataclasses.replace(spec, grouped=True)
    return LoraSlots(spec, config, dtype, mesh, num_request_slots, num_weight_args)


class NoLoraSlots:
    """A runner's LoRA slots without --enable-lora: no arrays, nothing to write or compile."""

    spec = None
    step_args = None  # make_step's `lora`
    description = ""  # the runner's program description (its executable cache key)

    def args(self) -> list:
        return []

    def compile(self) -> None:
        pass

    def adopt(self, weight_args: list) -> None:
        pass


class LoraSlots:
    def __init__(self, spec: LoraSpec, config: ModelConfig, dtype, mesh, num_request_slots: int,
                 num_weight_args: int):
        """`num_weight_args`: the model's weight arguments, which the slots' follow."""
        self.spec = spec
        self.step_args = LoraArgs(spec, config.num_layers, num_weight_args)
        self.description = f"\n{spec}"
        self.weights: list = []  # the runner's weight arguments, whose tail these are (`adopt`)
        self.dtype = jnp.dtype(dtype)
        self.shapes = slot_shapes(config, spec)
        self.widths = {module: (k, math.prod(axes)) for module, (k, axes) in
                       module_shapes(config).items()}
        shardings = [NamedSharding(mesh, part) for _, _, part in self.shapes]
        self._replicated = NamedSharding(mesh, P())
        self.arrays = [jax.jit(lambda s=shape: jnp.zeros(s, self.dtype), out_shardings=sharding)()
                       for (_, shape, _), sharding in zip(self.shapes, shardings)]
        self._host_adapters = np.zeros(num_request_slots, np.int32)
        self.slot_adapters = jax.device_put(self._host_adapters, self._replicated)

        def write(arrays, slot, values):
            out = []
            for (name, _, _), array, value in zip(self.shapes, arrays, values):
                if spec.grouped:  # [slots, panels, K, lanes]: the slot's packed matrix
                    value = gemm_cpu.pack_columns(value, bf16_pairs=False)[None]
                    start = (slot, 0, 0, 0)
                elif name.endswith(".a"):  # [K, slots * columns]: the slot's columns
                    start = (0, slot * value.shape[1])
                else:  # [slots * rank, N]: the slot's rows
                    start = (slot * value.shape[0], 0)
                out.append(jax.lax.dynamic_update_slice(array, value, start))
            return out

        self._write_slot = write
        self._write = jax.jit(write, donate_argnums=(0,), out_shardings=shardings)
        self._compiled = None
        self._adapters_format = self._replicated

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def args(self) -> list[jax.Array]:
        """The step's trailing weight arguments: the slot arrays, then slot_adapters."""
        return [*self.arrays, self.slot_adapters]

    def adopt(self, weight_args: list) -> None:
        """The runner's weight arguments, whose last ones are the slots' (`args()`'s order), as
        it now holds them: after precompile stored the weights in the layouts XLA chose (TPU;
        their old buffers freed), these arrays, and the slot write and slot_adapters' puts in
        the same layouts, so no step relays a slot out. A write or an assignment updates them."""
        self.weights = weight_args
        *self.arrays, self.slot_adapters = weight_args[-len(self.args()):]
        formats = [a.format for a in self.arrays]
        self._adapters_format = self.slot_adapters.format
        self._write = jax.jit(self._write_slot, donate_argnums=(0,),
                              in_shardings=(formats, None, None), out_shardings=formats)
        self._compiled = None

    def compile(self) -> None:
        """The slot write's program, before serving."""
        self._compiled = self._write.lower(self.arrays, np.int32(0),
                                           self._slot_values(None)).compile()

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Adapter slot `slot` holds `adapter` (None: zeros), for the steps dispatched from now."""
        values = self._slot_values(adapter)
        program = self._compiled or self._write
        self.arrays = program(self.arrays, np.int32(slot), values)
        self.weights[-len(self.args()):] = self.args()

    def check(self, adapter: LoraAdapter) -> None:
        """An adapter these slots cannot hold: a LoraAdapterError naming why."""
        if adapter.rank > self.spec.max_rank:
            raise LoraAdapterError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, over --max-lora-rank "
                f"{self.spec.max_rank}")
        missing = [m for m in adapter.target_modules if m not in self.spec.target_modules]
        if missing:
            raise LoraAdapterError(
                f"LoRA adapter {adapter.name!r} targets {', '.join(missing)}, which the server's "
                f"--lora-target-modules ({', '.join(self.spec.target_modules)}) leave out")

    def host_copy(self, adapter: LoraAdapter) -> LoraAdapter:
        """`adapter` as a server keeps it in host memory to write into a slot whenever a request
        needs it (issue 73): its matrices in the slots' dtype, which a write casts them to anyway
        (half of float32's bytes in bfloat16; the slot's values the same)."""
        if self.dtype == np.float32:
            return adapter
        return dataclasses.replace(adapter, weights={
            key: (a.astype(self.dtype), b.astype(self.dtype))
            for key, (a, b) in adapter.weights.items()})

    def _slot_values(self, adapter: LoraAdapter | None) -> list[np.ndarray]:
        """One slot's part of every slot array, on the host: the adapter's matrices with their
        rank padded to max_rank (zeros add nothing), zeros where it has none."""
        rank = self.spec.max_rank
        projections = self.spec.projections()
        values = []
        for name, _, _ in self.shapes:
            _, layer, part, kind = name.split(".")
            layer = int(layer)
            if kind == "a":  # [K, modules * rank] of the slot
                modules = projections[part]
                value = np.zeros((self.widths[modules[0]][0], len(modules) * rank), np.float32)
                for j, module in enumerate(modules):
                    found = adapter and adapter.weights.get((layer, module))
                    if found:
                        a = found[0]
                        value[:, j * rank:j * rank + a.shape[1]] = a
            else:  # [rank, N] of the slot
                value = np.zeros((rank, self.widths[part][1]), np.float32)
                found = adapter and adapter.weights.get((layer, part))
                if found:
                    b = found[1]
                    value[:b.shape[0]] = b.reshape(b.shape[0], -1)
            values.append(value.astype(self.dtype))
        return values

    def assign(self, request_slots: list[int], adapter_slots: list[int]) -> None:
        """Request slots' adapters (adapter slot + 1; 0: none), as requests start in their
        slots; the table is sent again only when it changed."""
        before = self._host_adapters.copy()
        self._host_adapters[request_slots] = adapter_slots
        if not np.array_equal(before, self._host_adapters):
            self.slot_adapters = self.weights[-1] = jax.device_put(self._host_adapters,
                                                                   self._adapters_format)
