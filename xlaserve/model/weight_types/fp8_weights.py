"""FP8 matmul weights, on GPUs with FP8 tensor cores (compute capability 8.9 and up: H100, H200,
L4, L40S, ...): `--quantization fp8` (dynamic: per-output-channel float8_e4m3fn weights quantized
at load from a float checkpoint, activations per token at each step) and FP8 checkpoints kept in
FP8 (fp8_kept.py) instead of dequantized at load. The same leaves as int8.py's are quantized
(qkv, o_proj, gate_up, down); elsewhere (CPU, TPU, older GPUs) `--quantization fp8` is refused
in one line (`check_fp8_platform`) and FP8 checkpoints are dequantized at load (fp8.py).

The values are stored with the contracted axes LAST, [N..., K...] (the float weight's
[K..., N...] with its axes moved), each output column's K values contiguous: FP8 tensor-core
MMAs (Hopper's wgmma) and cuBLASLt's FP8 GEMM read both operands K-major, so a [K, N] FP8 weight
is transposed inside XLA's GEMM on every step. Partition specs move with the axes.

- `Fp8Matrix`: a float32 scale per output column, [N...] (per-channel; a per-tensor checkpoint's
  one scale repeated). `fp8_matmul`: x quantized per row (token) to e4m3 with scale
  max |row| / 448 (1 for a row of zeros), `dot_general(x_fp8, w_fp8, preferred_element_type=
  float32)` - an FP8 x FP8 GEMM on H100 (XLA's Triton GEMM, tests/executor/test_compile_fp8.py) -
  then times the column scales (fused into the GEMM) and the row scales.
- `Fp8BlockMatrix`: an FP8 checkpoint's 128x128 block scales as a float32 scale per (K block,
  output column), [K / block_k, N...] (3% of the FP8 bytes at 128: column scales, not 128-column
  blocks, because the fused qkv interleaves the q, k and v projections' rows by kv head); its
  matmul is `Kernels.fp8_block_matmul` (pallas_kernels/fp8_block_matmul.py, which says why).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.weight_types.whole_weight import ReadWhole

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_COMPUTE_CAPABILITY = (8, 9)  # Ada and Hopper: the first NVIDIA GPUs with FP8 tensor cores


class _Fp8Weight(ReadWhole):
    """What both FP8 weight types share: nnx reads them whole; their float weight's shape."""

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[:len(self.values.shape) - self.contracted])

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape, [K..., N...]."""
        out = len(self.output_shape)
        return tuple(self.values.shape[out:]) + self.output_shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Matrix(_Fp8Weight):
    """values float8_e4m3fn [N..., K...], scales float32 [N...] (module docstring)."""

    values: jax.Array
    scales: jax.Array
    compute_dtype: str = dataclasses.field(metadata=dict(static=True))  # the model dtype

    @property
    def contracted(self) -> int:
        return len(self.values.shape) - len(self.scales.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8BlockMatrix(_Fp8Weight):
    """values float8_e4m3fn [N..., K...], scales float32 [K / block_k, N...] (module docstring)."""

    values: jax.Array
    scales: jax.Array
    compute_dtype: str = dataclasses.field(metadata=dict(static=True))
    block_k: int = dataclasses.field(metadata=dict(static=True))

    @property
    def contracted(self) -> int:
        return len(self.values.shape) - len(self.scales.shape) + 1


FP8_TYPES = (Fp8Matrix, Fp8BlockMatrix)


def fp8_platform_problem(device) -> str | None:
    """Why `device` has no FP8 matmul (one clause naming it), or None where it has one."""
    if device.platform == "gpu":
        capability = str(getattr(device, "compute_capability", "unknown"))
        parts = capability.split(".")
        if all(p.isdigit() for p in parts) and tuple(map(int, parts)) >= MIN_COMPUTE_CAPABILITY:
            return None
        return f"{device.device_kind} (compute capability {capability})"  # ROCm's: gfx942, ...
    return f"{device.platform.upper()} ({device.device_kind})"


def check_fp8_platform(device) -> None:
    """--quantization fp8 runs FP8 matmuls: on any other device it stops start-up here."""
    problem = fp8_platform_problem(device)
    if problem is not None:
        raise ValueError(f"--quantization fp8 needs FP8 matmuls, which {problem} does not have: "
                         "NVIDIA GPUs of compute capability 8.9+ (H100, H200, L4, L40S) have them; "
                         "--quantization int8 runs on every platform")


def quantize_fp8(weight: jax.Array, contracted: int, compute_dtype) -> Fp8Matrix:
    """`weight` [K..., N...] (its first `contracted` axes contracted) as an Fp8Matrix, computed in
    float32: scales[n] = max_k |w[k, n]| / 448, values = w / scales rounded to nearest e4m3 (a
    column of zeros: scale 0, values 0)."""
    w = weight.astype(jnp.float32)
    scales = jnp.max(jnp.abs(w), axis=tuple(range(contracted))) / FP8_MAX
    divisor = jnp.where(scales > 0, scales, 1.0)
    # Clipped: the quotient of the largest value may round just past 448, which e4m3fn (no
    # infinity) would turn into NaN.
    values = jnp.clip(w / divisor, -FP8_MAX, FP8_MAX).astype(FP8)
    return Fp8Matrix(jnp.transpose(values, _contracted_last(weight.ndim, contracted)), scales,
                     jnp.dtype(compute_dtype).name)


def dequantize(matrix: Fp8Matrix | Fp8BlockMatrix) -> jax.Array:
    """The float32 weight [K..., N...] an FP8 one stands for."""
    values = matrix.values.astype(jnp.float32)
    out = len(matrix.output_shape)
    if isinstance(matrix, Fp8Matrix):
        scaled = values * matrix.scales.reshape(*matrix.output_shape, *(1,) * matrix.contracted)
    else:
        k = math.prod(matrix.values.shape[out:])
        scales = jnp.repeat(jnp.moveaxis(matrix.scales, 0, -1), matrix.block_k, axis=-1)[..., :k]
        scaled = (values.reshape(*matrix.output_shape, k) * scales).reshape(values.shape)
    return jnp.transpose(scaled, tuple(range(out, values.ndim)) + tuple(range(out)))


def abstract_fp8(weight: jax.ShapeDtypeStruct, contracted: int,
                 block_k: int | None = None) -> Fp8Matrix | Fp8BlockMatrix:
    """The FP8 matrix of ShapeDtypeStructs a float parameter [K..., N...] becomes: per-channel,
    or with `block_k`, block-scaled. The values take the weight's partition spec with its axes
    moved, the scales that of its output axes."""
    sharding = weight.sharding
    spec = tuple(sharding.spec) + (None,) * (len(weight.shape) - len(sharding.spec))
    order = _contracted_last(len(weight.shape), contracted)
    moved = NamedSharding(sharding.mesh, P(*(spec[a] for a in order)))
    values = jax.ShapeDtypeStruct(tuple(weight.shape[a] for a in order), FP8, sharding=moved)
    dtype = jnp.dtype(weight.dtype).name
    out_shape, out_spec = tuple(weight.shape[contracted:]), spec[contracted:]
    if block_k is None:
        scales = jax.ShapeDtypeStruct(out_shape, jnp.float32,
                                      sharding=NamedSharding(sharding.mesh, P(*out_spec)))
        return Fp8Matrix(values, scales, dtype)
    k_blocks = -(-math.prod(weight.shape[:contracted]) // block_k)
    scales = jax.ShapeDtypeStruct((k_blocks, *out_shape), jnp.float32,
                                  sharding=NamedSharding(sharding.mesh, P(None, *out_spec)))
    return Fp8BlockMatrix(values, scales, dtype, block_k)


def float_weight(matrix: Fp8Matrix | Fp8BlockMatrix) -> jax.ShapeDtypeStruct:
    """The float parameter (shape, model dtype, sharding) an abstract FP8 matrix stands for."""
    sharding = matrix.values.sharding
    out = len(matrix.output_shape)
    spec = tuple(sharding.spec) + (None,) * (len(matrix.values.shape) - len(sharding.spec))
    return jax.ShapeDtypeStruct(matrix.shape, matrix.compute_dtype, sharding=NamedSharding(
        sharding.mesh, P(*spec[out:], *spec[:out])))


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (float8_e4m3fn [T, K], float32 [T]): each row divided by max |row| / 448 (1 for
    a row of zeros), clipped, rounded to nearest e4m3."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=1)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(x32 / scales[:, None], -FP8_MAX, FP8_MAX).astype(FP8), scales


def fp8_matmul(x: jax.Array, weight: Fp8Matrix) -> jax.Array:
    """x [T, K] @ weight -> float32 [T, N...] (module docstring). The output axes are kept, as
    layers.linear keeps a float weight's (a merged gate_up [2 * I] would not split over I)."""
    rows, k = x.shape
    values = weight.values.reshape(*weight.output_shape, k)  # K axes merged: free, they are last
    x_fp8, x_scales = quantize_rows(x)
    y = jax.lax.dot_general(x_fp8, values, (((1,), (values.ndim - 1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    # The column scales first: XLA fuses that multiply into the GEMM (the row scales, a broadcast
    # along the other axis, it does not; they fuse into the consumer instead).
    return y * weight.scales * x_scales.reshape(rows, *(1,) * len(weight.output_shape))


def fp8_block_linear(x: jax.Array, weight: Fp8BlockMatrix, block_matmul) -> jax.Array:
    """x [T, K] @ a block-scaled weight -> float32 [T, N...], by `block_matmul(x, values [N, K],
    scales [K blocks, N], block_k)` (Kernels.fp8_block_matmul)."""
    rows, k = x.shape
    if block_matmul is None:
        raise ValueError("block-scaled FP8 weights need the GPU block FP8 kernel "
                         "(Kernels.fp8_block_matmul), which this platform's kernels lack")
    n = math.prod(weight.output_shape)
    y = block_matmul(x, weight.values.reshape(n, k), weight.scales.reshape(-1, n), weight.block_k)
    return y.reshape(rows, *weight.output_shape)


def _contracted_last(ndim: int, contracted: int) -> tuple[int, ...]:
    return tuple(range(contracted, ndim)) + tuple(range(contracted))
