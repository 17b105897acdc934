"""FP8 checkpoints (formats/fp8.py's format) kept in FP8 on a GPU with FP8 matmuls, instead of
dequantized at load: each dense projection (qkv, o_proj, gate_up, down, a shared expert's) keeps the
file's float8_e4m3fn values and scales (fp8_weights.py), so a decode step reads one byte per weight.

    per-channel or per-tensor scales    -> Fp8Matrix, the FP8 x FP8 dot of `--quantization fp8`
    [bm, bk] block scales (128 x 128)   -> Fp8BlockMatrix, pallas_kernels/fp8_block_matmul.py

Everything else (embedding, LM head, norms, routers, the experts) is dequantized exactly as
formats/fp8.py does (the float32 product rounded once into the serving dtype); static activation
scales are not applied (activations are quantized per token at each step, as with dynamic ones).

Kept only where `kept_quantization` says: the mesh's devices have FP8 matmuls, every dense
projection of the file has a scale (a checkpoint that leaves some in float, e.g. through
`modules_to_not_convert`, is dequantized at load), and, for block scales, the mesh is one device
(the kernel is a custom call XLA's partitioner does not split) and every projection's shape suits
the kernel. Elsewhere the loader dequantizes at load, as before.

The conversion to our layout (weights.convert: q, k and v fused and interleaved by kv head, gate
and up stacked, everything transposed) is run twice in step, on two views of the file: one gives
each FP8 tensor's codes as float16 (which holds every e4m3 value exactly), the other its scale
repeated over every element it covers (float32; NaN for a tensor that is not FP8). The converted
pair gives, per parameter, the FP8 values and the scale of each of their elements in our layout,
whatever the conversion does; a projection keeps the scales of its first K index (per channel)
or of each K block's first index (block scales, whose K blocks are contiguous in our contracted
axes as in the file's input axis). The float32 scale copy costs 4 bytes a weight of host memory
per tensor while it is converted, like formats/fp8.py's float32 tiles.
"""
from __future__ import annotations

import logging
import math
import re

import ml_dtypes
import numpy as np

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.weights.formats.fp8 import (FP8_DTYPE, SCALE_SUFFIX, Fp8Error, Fp8Source,
                                          check_fp8_config, check_fp8_tensor)
from xlaserve.model.weight_types.fp8_weights import (FP8_TYPES, Fp8BlockMatrix, Fp8Matrix,
                                                     fp8_platform_problem)
from xlaserve.model.weight_types.int8 import QUANTIZED_WEIGHTS, Fp8Checkpoint, quantizes
from xlaserve.weights.formats.tensor_source import TensorSource
from xlaserve.weights.param_layout import convert
from xlaserve.pallas_kernels.fp8_block_matmul import supports

logger = logging.getLogger(__name__)

# The file's tensors that become our quantized leaves: every dense attention and MLP projection
# (a shared expert's too), not the experts of a mixture of experts (int8.QUANTIZED_WEIGHTS).
DENSE_PROJECTION = re.compile(r"^(?!.*\.experts\.).*\.(q|k|v|o|gate|up|down)_proj\.weight$")
# Every float8_e4m3fn bit pattern as float16 (exact: e4m3's 3 mantissa bits and exponents 2^-9 to
# 2^8 are inside float16's); NaN for the two NaN codes.
_FP8_TO_FLOAT16 = np.arange(256, dtype=np.uint8).view(FP8_DTYPE).astype(np.float16)


def kept_quantization(quant: dict, source: TensorSource, parameters: dict,
                      mesh) -> Fp8Checkpoint | None:
    """How the projections of an "fp8" checkpoint (its `quantization_config`, `quant`) stay FP8
    on `mesh`; None: dequantized at load, with a log line saying why where the devices have FP8
    matmuls. `parameters`: the float model's abstract parameters ({path: ShapeDtypeStruct})."""
    if fp8_platform_problem(mesh.devices.flat[0]):
        return None
    block = check_fp8_config(quant)
    names = source.names()
    unscaled = sorted(n for n in names
                      if DENSE_PROJECTION.search(n) and n + SCALE_SUFFIX not in names)
    reason = None
    if unscaled:
        reason = f"projections stored unquantized: {len(unscaled)} (e.g. {unscaled[0]})"
    elif block is not None and mesh.size > 1:
        reason = f"the block FP8 kernel runs on one device, not a mesh of {mesh.size}"
    elif block is not None:
        for path, p in parameters.items():
            if quantizes(path):
                contracted = QUANTIZED_WEIGHTS[str(path[-1])]
                problem = supports(math.prod(p.shape[contracted:]),
                                   math.prod(p.shape[:contracted]), block[1])
                if problem:
                    where = "/".join(map(str, path))
                    reason = f"the block FP8 kernel cannot multiply {where}: {problem}"
                    break
    if reason is not None:
        logger.info("FP8 checkpoint dequantized at load, not kept in FP8: %s", reason)
        return None
    logger.info("FP8 checkpoint kept in FP8 on %s: the attention and MLP projections multiply "
                "FP8 activations quantized per token%s; other FP8 tensors are dequantized at "
                "load%s",
                mesh.devices.flat[0].device_kind,
                "" if block is None else f" and {block[1]}-wide K block",
                "; its static activation scales are not applied"
                if str(quant.get("activation_scheme", "dynamic")).lower() == "static" else "")
    return Fp8Checkpoint(None if block is None else block[1])


def convert_kept(config: ModelConfig, source: TensorSource, quant: dict, dtype, expected: dict):
    """`(parameter path, array or FP8 matrix of numpy arrays)` for every parameter of an "fp8"
    checkpoint (`quant`: its quantization_config): the FP8 matrices where `expected` (the abstract
    parameters of `kept_quantization`'s quantization) has one, every other FP8 tensor dequantized
    into `dtype`, the rest as stored."""
    block_size = check_fp8_config(quant)
    codes = convert(config, Fp8Source(source, block_size, np.float16, decode=_codes))
    scales = convert(config, _ScalesSource(source, block_size))
    for (path, carrier), (_, scale) in zip(codes, scales):
        yield path, _parameter(path, carrier, scale, expected.get(path), np.dtype(dtype))


def _parameter(path: tuple, carrier: np.ndarray, scale: np.ndarray, want, dtype: np.dtype):
    name = "/".join(map(str, path))
    if _nan_everywhere(scale):  # no FP8 tensor in it
        if isinstance(want, FP8_TYPES):
            raise Fp8Error(f"parameter {name} has no FP8 tensor, yet the checkpoint was taken "
                           "to be kept in FP8")
        return carrier
    if np.isnan(scale).any():
        raise Fp8Error(f"parameter {name} fuses FP8 and float tensors, which is not supported")
    if not isinstance(want, FP8_TYPES):
        with np.errstate(over="ignore", invalid="ignore"):  # refused just below
            value = (carrier.astype(np.float32) * scale).astype(dtype)
        if not np.isfinite(value).all():
            raise Fp8Error(f"parameter {name}: an FP8 value times its scale is not finite in "
                           f"{dtype.name}")
        return value
    contracted = want.contracted
    order = tuple(range(contracted, carrier.ndim)) + tuple(range(contracted))
    values = np.transpose(carrier, order).astype(ml_dtypes.float8_e4m3fn, order="C")
    if isinstance(want, Fp8Matrix):
        kept_scales = scale[(0,) * contracted]  # the same along K: one scale per output column
        return Fp8Matrix(values, np.ascontiguousarray(kept_scales, np.float32), want.compute_dtype)
    k = math.prod(carrier.shape[:contracted])
    kept_scales = scale.reshape(k, *carrier.shape[contracted:])[::want.block_k]
    return Fp8BlockMatrix(values, np.ascontiguousarray(kept_scales, np.float32), want.compute_dtype,
                          want.block_k)


def _nan_everywhere(scale: np.ndarray) -> bool:
    if scale.size and not any(scale.strides):  # one broadcast value: _ScalesSource's NaN
        return bool(np.isnan(scale.flat[0]))
    return bool(np.isnan(scale).all())


def _codes(weight: np.ndarray, scale_inv: np.ndarray, block_size, dtype, name: str) -> np.ndarray:
    """An FP8 tensor's values as float16 (exact), after formats/fp8.py's checks; a NaN code is
    refused."""
    check_fp8_tensor(weight, scale_inv, block_size, name)
    codes = _FP8_TO_FLOAT16[np.asarray(weight).view(np.uint8)]
    if np.isnan(codes).any():
        raise Fp8Error(f"FP8 tensor {name!r} holds a NaN code")
    return codes


def _repeated_scales(weight: np.ndarray, scale_inv: np.ndarray, block_size, dtype,
                     name: str) -> np.ndarray:
    """float32 [..., out, in]: each element's scale (its block's, channel's or tensor's)."""
    block_rows, block_cols = check_fp8_tensor(weight, scale_inv, block_size, name)
    *lead, rows, cols = weight.shape
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    scale = np.asarray(scale_inv, np.float32).reshape(*lead, *grid)
    return np.repeat(np.repeat(scale, block_rows, axis=-2), block_cols, axis=-1)[..., :rows, :cols]


class _ScalesSource(Fp8Source):
    """The file with each FP8 tensor replaced by its scale repeated over the elements it covers
    (float32, the tensor's shape), every other tensor by NaN (a broadcast view: no memory)."""

    def __init__(self, source: TensorSource, block_size: tuple[int, int] | None):
        super().__init__(source, block_size, np.float32, decode=_repeated_scales)
        self._file = source

    def get(self, name: str) -> np.ndarray:
        if self.is_fp8(name):
            return super().get(name)
        return np.broadcast_to(np.float32(np.nan), self._file.get(name).shape)  # a memory map
