"""`--quantization int8`: weight-only, per-output-channel, symmetric int8, quantized at load from a
float checkpoint, multiplied by XLA on every platform.

A quantized weight is an `Int8Matrix`: the int8 values in the float weight's own shape and layout
(so its partition spec in sharding.py applies unchanged) and one float32 scale per output column,
shaped like the weight's output axes and sharded like them. For a weight whose first `contracted`
axes multiply to K, column n of the [K, N] matrix is `values[:, n] * scales[n]`, with
`scales[n] = max_k |w[k, n]| / 127` and `values = round(w / scales)` (to nearest, ties to even); a
column of zeros gets scale 0 and values 0.

`layers.linear` multiplies x by `values.astype(x's dtype)` with float32 accumulation and scales the
float32 result per column: XLA fuses the convert into the dot's operand on TPU and GPU, so a step
reads one byte per weight (half of bfloat16's) and no bfloat16 copy of a weight is made.

Quantized: the dense matmuls of attention and the MLP (qkv, o_proj, gate_up, down; a shared
expert's too). Kept in the model dtype: the embedding and the LM head (their logits are the most
sensitive to rounding and a tied embedding is also a lookup table), norms, biases, routers and the
mixture-of-experts' experts (their grouped matmuls take plain arrays).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

QUANTIZATIONS = ("int8",)
# The quantized leaves, by name, with how many of their leading axes are contracted.
QUANTIZED_WEIGHTS = {"qkv": 1, "o_proj": 2, "gate_up": 1, "down": 1}
INT8_MAX = 127


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Matrix:
    """A matmul weight as int8 values [K..., N...] and float32 scales [N...] (module docstring)."""

    values: jax.Array
    scales: jax.Array
    # The dtype x and the values go into the dot in (the model dtype).
    compute_dtype: str = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, index):
        """nnx reads a Variable's value as `variable[...]`: the whole weight."""
        if index is not Ellipsis:
            raise TypeError("an int8 weight is read whole (`[...]`)")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def contracted(self) -> int:
        return len(self.values.shape) - len(self.scales.shape)


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; supported: {', '.join(QUANTIZATIONS)}")


def refuse_quantized_checkpoint(quantization: str | None, checkpoint_method: str | None,
                                where: str) -> None:
    """--quantization int8 quantizes float weights; a checkpoint already quantized (FP8, AWQ,
    GPTQ, MXFP4, a GGUF file) would be quantized twice, so it is refused in one line."""
    if quantization is not None and checkpoint_method is not None:
        raise ValueError(f"--quantization {quantization} needs a float checkpoint; {where} is "
                         f"already quantized ({checkpoint_method}): serve it without --quantization")


def quantizes(path: tuple) -> bool:
    return str(path[-1]) in QUANTIZED_WEIGHTS


def quantize(weight: jax.Array, contracted: int, compute_dtype) -> Int8Matrix:
    """`weight` [K..., N...] (its first `contracted` axes contracted) as an Int8Matrix, computed
    in float32."""
    w = weight.astype(jnp.float32)
    reduce_axes = tuple(range(contracted))
    scales = jnp.max(jnp.abs(w), axis=reduce_axes) / INT8_MAX
    divisor = jnp.where(scales > 0, scales, 1.0)  # a zero column: values 0 (w / 1)
    values = jnp.clip(jnp.round(w / divisor), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return Int8Matrix(values, scales, jnp.dtype(compute_dtype).name)


def dequantize(matrix: Int8Matrix) -> jax.Array:
    """The float32 weight the int8 one stands for."""
    return matrix.values.astype(jnp.float32) * matrix.scales


def abstract_int8(path: tuple, weight: jax.ShapeDtypeStruct) -> Int8Matrix:
    """The Int8Matrix of ShapeDtypeStructs a float parameter becomes: values sharded as the
    weight, scales as its output axes."""
    contracted = QUANTIZED_WEIGHTS[str(path[-1])]
    sharding = weight.sharding
    spec = tuple(sharding.spec) + (None,) * (len(weight.shape) - len(sharding.spec))
    scale_sharding = NamedSharding(sharding.mesh, P(*spec[contracted:]))
    return Int8Matrix(jax.ShapeDtypeStruct(weight.shape, jnp.int8, sharding=sharding),
                      jax.ShapeDtypeStruct(weight.shape[contracted:], jnp.float32,
                                           sharding=scale_sharding),
                      jnp.dtype(weight.dtype).name)


def quantized_parameters(parameters: dict) -> dict:
    """`{path: ShapeDtypeStruct}` with every quantized weight as its `abstract_int8`."""
    return {path: abstract_int8(path, p) if quantizes(path) else p
            for path, p in parameters.items()}


def quantize_placed(weight: jax.Array, want: Int8Matrix) -> Int8Matrix:
    """`weight` (on its devices) quantized into `want`'s shardings (`abstract_int8`): each device
    quantizes its own columns, no host copy."""
    return _quantizer(want.contracted, want.compute_dtype, want.values.sharding,
                      want.scales.sharding)(weight)


@functools.lru_cache(maxsize=None)
def _quantizer(contracted: int, compute_dtype: str, values_sharding, scales_sharding):
    out = Int8Matrix(values_sharding, scales_sharding, compute_dtype)
    return jax.jit(functools.partial(quantize, contracted=contracted, compute_dtype=compute_dtype),
                   out_shardings=out)


def quantize_model(model) -> None:
    """Quantizes a float `model`'s quantized weights in place (a restored Orbax checkpoint)."""
    _, state = nnx.split(model)
    values = {}
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        if quantizes(path) and not isinstance(value, Int8Matrix):
            want = abstract_int8(path, jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                            sharding=value.sharding))
            value = quantize_placed(value, want)
        values[path] = value
    nnx.update(model, nnx.from_flat_state(values))
