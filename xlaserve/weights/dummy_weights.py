"""`--load-format dummy`: random weights for a model's config, made where they will live.

As SGLang's and vLLM's dummy format, for profiling and benchmarks of a model's shapes without
its checkpoint. Every parameter is made by a jitted initializer whose output sharding is the
parameter's partition spec on the mesh, so each device computes only its own shard: no host copy
of the model, no full copy on one device first. One program is compiled per (kind, shape, dtype,
sharding), which the layers share.

Values keep the forward numerically sane in bfloat16 through a deep stack: matrices and biases
are uniform with a standard deviation of 0.02 (the usual `initializer_range`), RMSNorm scales 1.
They come from a counter-based hash of each element's index, not from `jax.random`: on a 2-core
CPU, threefry normals took 3.9 s per 136M values (15 s to make Qwen2.5-0.5B), the hash 0.14 s.
The hash is elementwise, so it partitions like the output; the values do not depend on the mesh.
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.weight_types.int8 import QUANTIZED_TYPES, float_weight, quantize_placed
from xlaserve.model.weight_types.mxfp4_experts import Mxfp4Experts
from xlaserve.model.registry import model_class
from xlaserve.model.transformer import abstract_parameters

INIT_STD = 0.02
_NORM_SCALE = "scale"  # the leaf name of every RMSNorm's weight (layers.RMSNorm)


def dummy_model(config: ModelConfig, *, dtype, mesh: Mesh, seed: int = 0,
                quantization: str | None = None):
    """The model of `config` with random weights, each parameter sharded by its partition spec;
    with `quantization` "int8" or "fp8", the quantized weights are the same random floats
    quantized; "mxfp4": gpt-oss's experts as random MXFP4 codes and scales (`_random_mxfp4`)."""
    graphdef, _, parameters = abstract_parameters(config, jnp.dtype(dtype), mesh,
                                                  model_class(config.architecture), quantization)
    values = {}
    for path, want in parameters.items():
        if isinstance(want, QUANTIZED_TYPES):
            values[path] = quantize_placed(_random(path, float_weight(want), seed), want)
        elif isinstance(want, Mxfp4Experts):
            values[path] = _random_mxfp4(path, want, seed)
        else:
            values[path] = _random(path, want, seed)
    return nnx.merge(graphdef, nnx.from_flat_state(values))


def dummy_values(parameters: dict, seed: int = 0) -> dict:
    """{path: random array} for {path: ShapeDtypeStruct with its sharding}, as `dummy_model`
    makes them (a speculative draft head's, weights/draft_head.py)."""
    return {path: _random(path, parameter, seed) for path, parameter in parameters.items()}


def _random(path: tuple, parameter, seed: int) -> jax.Array:
    kind = "ones" if str(path[-1]) == _NORM_SCALE else "uniform"
    initializer = _initializer(kind, tuple(parameter.shape), parameter.dtype, parameter.sharding)
    return initializer(np.uint32(parameter_key(seed, path)))


def _random_mxfp4(path: tuple, want: Mxfp4Experts, seed: int) -> Mxfp4Experts:
    """Every code equally likely, scales 2**-9 to 2**-6 (E8M0 bytes 118-121): values of about
    the float weights' 0.02 (MXFP4's magnitudes average 2.6 times the scale)."""
    key = np.uint32(parameter_key(seed, path))
    return Mxfp4Experts(_initializer("bytes", tuple(want.blocks.shape), jnp.uint8,
                                     want.blocks.sharding)(key),
                        _initializer("scale_bytes", tuple(want.scales.shape), jnp.uint8,
                                     want.scales.sharding)(key))


def parameter_key(seed: int, path: tuple) -> int:
    """A 32-bit key per (seed, parameter name): stable across processes (unlike hash()), and a
    parameter keeps its values when others are added."""
    return zlib.crc32(f"{seed}/{'/'.join(map(str, path))}".encode())


@functools.lru_cache(maxsize=None)
def _initializer(kind: str, shape: tuple[int, ...], dtype, sharding: NamedSharding):
    def init(key):
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind in ("bytes", "scale_bytes"):  # MXFP4's
            bits = _hashed(_element_index(shape), key)
            if kind == "bytes":
                return (bits >> 24).astype(dtype)
            return (jnp.uint32(118) + (bits >> 30)).astype(dtype)
        return (INIT_STD * _uniform_unit_variance(_element_index(shape), key)).astype(dtype)

    return jax.jit(init, out_shardings=sharding)


def _element_index(shape: tuple[int, ...]) -> jax.Array:
    """uint32 row-major index of every element (modulo 2**32), built from per-axis iotas so that
    each device makes only its shard's (a reshaped 1-d iota would be whole on every device)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _mix(x: jax.Array) -> jax.Array:
    # lowbias32 (Chris Wellons' hash-prospector): a bijection of uint32 with good avalanche.
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _hashed(index: jax.Array, key: jax.Array) -> jax.Array:
    """uint32 bits of each index under the key: two keyed rounds, so that another key gives
    other values, not the same ones permuted."""
    return _mix(_mix(index * jnp.uint32(0x9E3779B1) + key) ^ key)


def _uniform_unit_variance(index: jax.Array, key: jax.Array) -> jax.Array:
    """float32 uniform on [-sqrt(3), sqrt(3)) (mean 0, variance 1) from each index and the key
    (`_hashed`)."""
    bits = _hashed(index, key)
    unit = (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))  # the top 24 bits: [0, 1)
    return (unit - 0.5) * (12.0 ** 0.5)
