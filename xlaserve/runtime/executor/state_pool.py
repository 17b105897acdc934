"""The linear layers' state pool (issue 76): hybrid models' Gated DeltaNet layers
(model/linear_attention.py) and Nemotron-H's Mamba-2 layers (model/mamba2.py) keep no KV cache but a state per request, in one slot of a pool per
layer, beside the KV pool's pages. A running request's slot is its request slot
(`Request.slot`, 1..max_running_requests; slot 0 the padding rows' null slot), so the pool has
max_running_requests + 1 slots, and admission by request slots is admission by this pool. The
state is written in place by each step (donated with the KV pool: never copied per step), and a
request's first prompt token starts from zeros (pallas_kernels/linear_attention/reference.py), so
a slot is neither zeroed nor copied when it changes hands.

Both parts are float32: the delta rule's matrices are its running sums, and the convolution's
window holds projections already rounded to the model dtype, which float32 holds exactly (a
window is 1/20 of a slot's bytes in Qwen3.5's layers)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.linear_attention import LinearState, state_shapes
from xlaserve.model.mamba2 import Mamba2State
from xlaserve.model.mamba2 import state_shapes as mamba2_state_shapes
from xlaserve.model.sharding import CONV_STATE_SPEC, DELTA_STATE_SPEC
from xlaserve.runtime.scheduler.state_reuse import STATE_COPIES

STATE_DTYPE = jnp.float32


def state_bytes_per_slot(config: ModelConfig) -> int:
    """One request's state in every linear layer, in bytes (0 without linear layers)."""
    if not config.state_layers:
        return 0
    shapes = jax.tree.leaves(layer_state_shapes(config, 1),
                             is_leaf=lambda x: isinstance(x, tuple))
    return len(config.state_layers) * sum(
        math.prod(shape) for shape in shapes) * jnp.dtype(STATE_DTYPE).itemsize


def layer_state_shapes(config: ModelConfig, slots: int):
    """A linear layer's pools' shapes (tuples) for `slots` slots: a LinearState (Gated
    DeltaNet's) or a Mamba2State (Nemotron-H's, model/mamba2.py)."""
    if config.mamba2 is not None:
        return mamba2_state_shapes(config.mamba2, slots)
    return state_shapes(config.linear_attention, slots)


def state_pool_specs(config: ModelConfig, num_slots: int, mesh: Mesh) -> list:
    """Each linear layer's pools as jax.ShapeDtypeStructs, split by head as the layer is
    (model/sharding.py)."""
    if not config.state_layers:
        return []
    if num_slots < 2:
        raise ValueError(f"{config.architecture} keeps a state per request: the state pool needs "
                         f"its request slots (got {num_slots} with the null slot)")
    shapes = layer_state_shapes(config, num_slots)
    one = lambda shape, spec: jax.ShapeDtypeStruct(shape, STATE_DTYPE,
                                                   sharding=NamedSharding(mesh, spec))
    if isinstance(shapes, Mamba2State):  # [slots, H, P, N] split by head as the delta's
        return [Mamba2State(conv=one(shapes.conv, CONV_STATE_SPEC),
                            ssm=one(shapes.ssm, DELTA_STATE_SPEC))
                for _ in config.state_layers]
    return [LinearState(conv=one(shapes.conv, CONV_STATE_SPEC),
                        delta=one(shapes.delta, DELTA_STATE_SPEC))
            for _ in config.state_layers]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StateCopies:
    """A step's copies between state-pool slots (the prefix cache's, scheduler/state_reuse.py):
    `restores` run before the forward (a cached prefix's snapshot into an admitted request's
    slot), `snapshots` after it (a request's state into a snapshot slot). Each i32[2, capacity],
    (source, destination) per column, the used columns first, the rest -1."""

    restores: np.ndarray
    snapshots: np.ndarray

    @staticmethod
    def of(restores, snapshots, capacity: int) -> "StateCopies":
        """From lists of (source, destination) pairs, at most `capacity` of each."""
        if len(restores) > capacity or len(snapshots) > capacity:
            raise ValueError(f"{len(restores)} restores and {len(snapshots)} snapshots in a step "
                             f"that takes {capacity} of each")
        arrays = []
        for pairs in (restores, snapshots):
            array = np.full((2, capacity), -1, np.int32)
            if pairs:
                array[:, :len(pairs)] = np.asarray(pairs, np.int32).T
            arrays.append(array)
        return StateCopies(*arrays)

    def taking(self, restores, snapshots) -> "StateCopies":
        """These copies in arrays of this one's capacity (this one where there are none)."""
        if not restores and not snapshots:
            return self
        return StateCopies.of(restores, snapshots, self.restores.shape[1])


def copy_capacity(config: ModelConfig) -> int:
    """The state copies of each kind a step of this model takes (0 without linear layers)."""
    return STATE_COPIES if config.state_layers else 0


def no_copies(config: ModelConfig) -> StateCopies:
    """An idle step's (and any step without copies) StateCopies for this model."""
    return StateCopies.of((), (), copy_capacity(config))


def copy_states(caches: list, copies: jax.Array, first: int) -> list:
    """`caches` with, in each linear layer's pools (`caches[first:]`, LinearStates or
    Mamba2States), slot `copies[1, i]` set to slot `copies[0, i]` for each used column in
    order: a loop as long as the copies, nothing done in a step without any (most steps)."""
    if copies.shape[1] == 0:
        return caches
    count = jnp.sum(copies[1] >= 0)

    def one(i, states):
        source, target = copies[0, i], copies[1, i]
        return jax.tree.map(lambda pool: pool.at[target].set(pool[source]), states)

    return caches[:first] + list(jax.lax.fori_loop(0, count, one, tuple(caches[first:])))
