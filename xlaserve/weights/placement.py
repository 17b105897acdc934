"""Host arrays onto a sharding that may span several processes' devices (multi-host serving).

`jax.device_put(host, sharding)` into a sharding with devices of other processes first checks
that every process passed the same data, by all-gathering it across processes (JAX 0.10's
`multihost_utils.assert_equal`): a blocking collective per call, and for weights a copy of each
tensor from every host. Here each process puts only its own devices' shards of the data that
every process passes equal by construction (the same checkpoint; the leader's step arrays).
"""
from __future__ import annotations

import jax
from jax.sharding import Sharding


def put(tree, sharding: Sharding):
    """`jax.device_put(tree, sharding)` for a pytree of host arrays, without the cross-process
    check where the sharding spans several processes."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: put_global(x, sharding), tree)


def put_global(host, sharding: Sharding) -> jax.Array:
    """One host array onto `sharding`, this process's shards only."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
