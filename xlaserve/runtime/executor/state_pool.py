"""The linear layers' state pool (issue 76): hybrid models' Gated DeltaNet layers
(model/linear_attention.py) keep no KV cache but a state per request, in one slot of a pool per
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

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.linear_attention import LinearState, state_shapes
from xlaserve.model.sharding import CONV_STATE_SPEC, DELTA_STATE_SPEC

STATE_DTYPE = jnp.float32


def state_bytes_per_slot(config: ModelConfig) -> int:
    """One request's state in every linear layer, in bytes (0 without linear layers)."""
    if not config.state_layers:
        return 0
    return len(config.state_layers) * config.linear_attention.state_bytes


def state_pool_specs(config: ModelConfig, num_slots: int, mesh: Mesh) -> list[LinearState]:
    """Each linear layer's pools as jax.ShapeDtypeStructs, split by head as the layer is
    (model/sharding.py)."""
    if not config.state_layers:
        return []
    if num_slots < 2:
        raise ValueError(f"{config.architecture} keeps a state per request: the state pool needs "
                         f"its request slots (got {num_slots} with the null slot)")
    shapes = state_shapes(config.linear_attention, num_slots)
    one = lambda shape, spec: jax.ShapeDtypeStruct(shape, STATE_DTYPE,
                                                   sharding=NamedSharding(mesh, spec))
    return [LinearState(conv=one(shapes.conv, CONV_STATE_SPEC),
                        delta=one(shapes.delta, DELTA_STATE_SPEC))
            for _ in config.state_layers]
