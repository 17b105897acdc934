"""The LoRA adapter slots on the device (issue 53; the product is model/lora.py).

The slot arrays (`model/lora.slot_shapes`) and `slot_adapters` (each request slot's adapter: 0
none, s + 1 adapter slot s) ride at the end of the step's weight arguments
(`ModelRunner._weight_args`), so every program, precompiled or compiled ahead of time, takes
them like weights. Loading an adapter writes its slot (`write`: one program over every slot
array, the slot a traced index, compiled at start-up, the arrays donated and updated in place);
unloading zeroes it. Same shapes, same shardings: no step compiles again.
"""
from __future__ import annotations

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


class LoraSlots:
    def __init__(self, spec: LoraSpec, config: ModelConfig, dtype, mesh, num_request_slots: int):
        self.spec = spec
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

    def adopt(self, args: list[jax.Array]) -> None:
        """The step's slot arguments (`args()`'s order) as the runner now holds them: after
        precompile stored the weights in the layouts XLA chose (TPU; their old buffers freed),
        these arrays, and the slot write and slot_adapters' puts in the same layouts, so no
        step relays a slot out."""
        *self.arrays, self.slot_adapters = args
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
        """Adapter slot `slot` holds `adapter` (None: zeros)."""
        values = self._slot_values(adapter)
        program = self._compiled or self._write
        self.arrays = program(self.arrays, np.int32(slot), values)

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

    def assign(self, request_slots: list[int], adapter_slots: list[int]) -> bool:
        """Request slots' adapters (adapter slot + 1; 0: none), as requests start in their
        slots; the table is sent again only when it changed. Returns whether it did."""
        before = self._host_adapters.copy()
        self._host_adapters[request_slots] = adapter_slots
        if np.array_equal(before, self._host_adapters):
            return False
        self.slot_adapters = jax.device_put(self._host_adapters, self._adapters_format)
        return True
