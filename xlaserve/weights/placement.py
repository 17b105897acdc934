"""Weights onto their devices: the model from converted `(parameter path, array)` pairs, each put
with its partition spec (`place_model`), and host arrays onto a sharding that may span several
processes' devices (multi-host serving).

`jax.device_put(host, sharding)` into a sharding with devices of other processes first checks
that every process passed the same data, by all-gathering it across processes (JAX 0.10's
`multihost_utils.assert_equal`): a blocking collective per call, and for weights a copy of each
tensor from every host. Here each process puts only its own devices' shards of the data that
every process passes equal by construction (the same checkpoint; the leader's step arrays).
"""
from __future__ import annotations

import itertools

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, Sharding
from tqdm.auto import tqdm

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.weight_types.fp8_weights import FP8_TYPES
from xlaserve.model.weight_types.int8 import QUANTIZED_TYPES, float_weight, quantize_placed
from xlaserve.model.weight_types.mxfp4_experts import Mxfp4Experts
from xlaserve.model.weight_types.quantized_rows import QuantizedLinear
from xlaserve.model.registry import model_class
from xlaserve.model.transformer import abstract_parameters
from xlaserve.weights.encoder_layout import encoder_weights
from xlaserve.weights.param_layout import WeightError, convert
from xlaserve.weights.vision_layout import vision_weights


def put(tree, sharding: Sharding):
    """`jax.device_put(tree, sharding)` for a pytree of host arrays, without the cross-process
    check where the sharding spans several processes."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: put_global(x, sharding), tree)


def put_global(host, sharding: Sharding) -> jax.Array:
    """One host array onto `sharding`, this process's shards only."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _placed(array, dtype, sharding: Sharding) -> jax.Array:
    """`array` in `dtype` on `sharding`: a host array put there, a jax.Array (a trainer's
    update, weights/in_memory.py) cast and moved by XLA without leaving the devices."""
    if isinstance(array, jax.Array):
        return jax.device_put(array.astype(dtype), sharding)
    return put(np.asarray(array, dtype=dtype), sharding)


def build_model(config: ModelConfig, source, *, dtype, mesh: Mesh, progress: bool = True,
                quantization: str | None = None):
    """Convert every tensor of `source` (an encoder's: encoder_layout.py) and put it on `mesh`
    with its partition spec."""
    tensors = (encoder_weights(config, source) if config.encoder is not None
               else convert(config, source))
    if config.vision is not None:  # a vision-language model's tower (vision_layout.py)
        tensors = itertools.chain(tensors, vision_weights(config.vision, source))
    return place_model(config, tensors, dtype=dtype, mesh=mesh, progress=progress,
                       abstract=expected_parameters(config, dtype, mesh, quantization))


def expected_parameters(config: ModelConfig, dtype, mesh: Mesh, quantization: str | None = None):
    """(graphdef, {parameter path: ShapeDtypeStruct with its sharding, or a quantized matrix of
    them})."""
    graphdef, _, expected = abstract_parameters(config, dtype, mesh, model_class(config.architecture),
                                                quantization)
    return graphdef, expected


def place_model(config: ModelConfig, tensors, *, dtype, mesh: Mesh, progress: bool = True,
                abstract=None):
    """The model from `(parameter path, array)` pairs in our layout, each put on `mesh` with its
    partition spec (a weight to quantize is put in float32 and quantized where it lies; an FP8
    matrix kept from its checkpoint is put as it is). `abstract`: `expected_parameters(config, dtype,
    mesh)`, where the caller has it."""
    graphdef, expected = abstract or expected_parameters(config, dtype, mesh)
    loaded = {}
    with tqdm(total=len(expected), desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path, array in tensors:
            if path not in expected:
                raise WeightError(f"converted tensor {path} has no place in {config.architecture}")
            want = expected[path]
            if tuple(array.shape) != tuple(want.shape):
                raise WeightError(f"parameter {path}: got shape {array.shape}, expected {want.shape}")
            # Multi-host: each process puts only its own devices' shards (`put`).
            # GGUF blocks, placed already (kept_quantized/gguf_kept.py)
            if isinstance(array, QuantizedLinear):
                loaded[path] = array
            elif isinstance(array, (*FP8_TYPES, Mxfp4Experts)):  # kept as the file has them
                # (kept_quantized/fp8_kept.py, mxfp4_kept.py)
                loaded[path] = jax.tree.map(lambda part, where: put(part, where.sharding),
                                            array, want)
            elif isinstance(want, QUANTIZED_TYPES):
                loaded[path] = quantize_placed(
                    _placed(array, np.float32, float_weight(want).sharding), want)
            else:
                loaded[path] = _placed(array, dtype, want.sharding)
            bar.update(1)
    missing = set(expected) - set(loaded)
    if missing:
        raise WeightError(f"no weights were loaded for {sorted(missing)}")
    state = nnx.from_flat_state(loaded)
    return nnx.merge(graphdef, state)


