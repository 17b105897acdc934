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

The same leaves, placed the same way, are `--quantization fp8`'s and an FP8 checkpoint's kept in
FP8 (fp8_weights.py): `quantized_parameters`, `quantize_placed` and `quantize_model` below serve
every quantization.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.weight_types import fp8_weights
from xlaserve.model.weight_types.fp8_weights import FP8_TYPES, Fp8Matrix
from xlaserve.model.weight_types.mxfp4_experts import MXFP4_KEPT
from xlaserve.model.weight_types.mxfp4_experts import abstract_mxfp4
from xlaserve.model.weight_types.whole_weight import ReadWhole

# "mxfp4" quantizes nothing: it keeps a gpt-oss checkpoint's MXFP4 experts as they are stored
# (mxfp4_experts.py, weights/kept_quantized/mxfp4_kept.py), where they would be decoded to the
# model dtype.
QUANTIZATIONS = ("int8", "fp8", "mxfp4")
# The quantized leaves, by name, with how many of their leading axes are contracted.
QUANTIZED_WEIGHTS = {"qkv": 1, "o_proj": 2, "gate_up": 1, "down": 1}
INT8_MAX = 127


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Matrix(ReadWhole):
    """A matmul weight as int8 values [K..., N...] and float32 scales [N...] (module docstring)."""

    values: jax.Array
    scales: jax.Array
    # The dtype x and the values go into the dot in (the model dtype).
    compute_dtype: str = dataclasses.field(metadata=dict(static=True))


    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def contracted(self) -> int:
        return len(self.values.shape) - len(self.scales.shape)


@dataclasses.dataclass(frozen=True)
class Fp8Checkpoint:
    """The quantization of an FP8 checkpoint kept in FP8 (weights/kept_quantized/fp8_kept.py):
    its weights as `Fp8BlockMatrix`es of `block_k` K blocks, or per-channel `Fp8Matrix`es
    (block_k None)."""

    block_k: int | None = None


QUANTIZED_TYPES = (Int8Matrix, *FP8_TYPES)


def check_quantization(quantization: str | Fp8Checkpoint | None) -> None:
    if (quantization is not None and quantization not in QUANTIZATIONS
            and not isinstance(quantization, Fp8Checkpoint)):
        raise ValueError(f"unknown quantization {quantization!r}; supported: {', '.join(QUANTIZATIONS)}")


def check_platform(quantization: str | Fp8Checkpoint | None, device) -> None:
    """FP8 weights need a device with FP8 matmuls (fp8_weights.check_fp8_platform), MXFP4
    experts an NVIDIA GPU (the kernel that decodes them); int8 runs everywhere."""
    if quantization == "fp8" or isinstance(quantization, Fp8Checkpoint):
        fp8_weights.check_fp8_platform(device)
    if quantization == "mxfp4" and device.platform != "gpu":
        raise ValueError(f"--quantization mxfp4 keeps MXFP4 experts for the NVIDIA GPU kernel; "
                         f"this is {device.platform}: serve without it (the experts are then "
                         f"decoded at load)")


def refuse_quantized_checkpoint(quantization: str | None, checkpoint_method: str | None,
                                where: str) -> None:
    """--quantization int8 or fp8 quantizes float weights; a checkpoint already quantized (FP8,
    AWQ, GPTQ, MXFP4, a GGUF file) would be quantized twice, so it is refused in one line.
    --quantization mxfp4 keeps an MXFP4 checkpoint's experts: any other is refused."""
    if quantization == "mxfp4":
        if checkpoint_method != "mxfp4":
            raise ValueError(f"--quantization mxfp4 keeps a gpt-oss checkpoint's MXFP4 experts; "
                             f"{where} has none ({checkpoint_method or 'float weights'})")
        return
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


def abstract_quantized(path: tuple, weight: jax.ShapeDtypeStruct,
                       quantization: str | Fp8Checkpoint):
    """The quantized matrix of ShapeDtypeStructs the float parameter at `path` becomes."""
    if quantization == "int8":
        return abstract_int8(path, weight)
    contracted = QUANTIZED_WEIGHTS[str(path[-1])]
    block_k = quantization.block_k if isinstance(quantization, Fp8Checkpoint) else None
    return fp8_weights.abstract_fp8(weight, contracted, block_k)


def quantized_parameters(parameters: dict, quantization: str | Fp8Checkpoint = "int8") -> dict:
    """`{path: ShapeDtypeStruct}` with every quantized weight as its `abstract_quantized`; FP8
    ones only where the mesh's devices have FP8 matmuls (else one line says so). "mxfp4": the
    experts as `mxfp4_experts.Mxfp4Experts` of ShapeDtypeStructs, the rest as it was."""
    meshes = [p.sharding.mesh for p in parameters.values() if hasattr(p.sharding, "mesh")]
    if meshes:
        check_platform(quantization, meshes[0].devices.flat[0])
    if quantization == "mxfp4":
        return {path: abstract_mxfp4(str(path[-1]), p) if str(path[-1]) in MXFP4_KEPT else p
                for path, p in parameters.items()}
    return {path: abstract_quantized(path, p, quantization) if quantizes(path) else p
            for path, p in parameters.items()}


def float_weight(want) -> jax.ShapeDtypeStruct:
    """The float parameter (shape, model dtype, sharding) an abstract quantized matrix stands for:
    what the loader puts on the devices before `quantize_placed`."""
    if isinstance(want, Int8Matrix):
        return jax.ShapeDtypeStruct(want.shape, want.compute_dtype, sharding=want.values.sharding)
    return fp8_weights.float_weight(want)


def quantize_placed(weight: jax.Array, want: Int8Matrix | Fp8Matrix) -> Int8Matrix | Fp8Matrix:
    """`weight` (on its devices) quantized into `want`'s shardings (`abstract_quantized`): each
    device quantizes its own columns, no host copy."""
    if not isinstance(want, (Int8Matrix, Fp8Matrix)):
        raise TypeError(f"{type(want).__name__} weights come quantized from their checkpoint")
    return _quantizer(type(want), want.contracted, want.compute_dtype, want.values.sharding,
                      want.scales.sharding)(weight)


@functools.lru_cache(maxsize=None)
def _quantizer(kind: type, contracted: int, compute_dtype: str, values_sharding, scales_sharding):
    out = kind(values_sharding, scales_sharding, compute_dtype)
    method = quantize if kind is Int8Matrix else fp8_weights.quantize_fp8
    return jax.jit(functools.partial(method, contracted=contracted, compute_dtype=compute_dtype),
                   out_shardings=out)


def quantize_model(model, quantization: str = "int8") -> None:
    """Quantizes a float `model`'s quantized weights in place (a restored Orbax checkpoint)."""
    _, state = nnx.split(model)
    values = {}
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        if quantizes(path) and not isinstance(value, QUANTIZED_TYPES):
            check_platform(quantization, value.sharding.mesh.devices.flat[0])
            want = abstract_quantized(path, jax.ShapeDtypeStruct(
                value.shape, value.dtype, sharding=value.sharding), quantization)
            value = quantize_placed(value, want)
        values[path] = value
    nnx.update(model, nnx.from_flat_state(values))
