"""FP8 checkpoints (`quant_method: "fp8"`, transformers' FineGrainedFP8 as DeepSeek-V3 and the
Qwen3 "-FP8" models ship them), dequantized exactly to the serving dtype at load (host side, numpy).

A quantized linear stores two tensors (everything else in the file is a plain float tensor):

  `<name>`            float8_e4m3fn [..., out, in]
  `<name>_scale_inv`  float32 [..., ceil(out/bm), ceil(in/bn)] for `weight_block_size` [bm, bn]
                      (128x128 in every released checkpoint), or [..., out, 1] per output channel,
                      or one value per tensor

`<name>` is `...q_proj.weight` (scale `...q_proj.weight_scale_inv`) or a stacked expert matrix such
as `...experts.gate_up_proj` (`...gate_up_proj_scale_inv`). Element [i, j] is
`float32(w[i, j]) * scale[i // bm, j // bn]`, the float32 product rounded once into the serving
dtype: transformers' `Fp8Dequantize` bit for bit (it multiplies in float32, then `.to(dtype)`).
Blocks at the right and bottom edges may be partial (DeepSeek-V3's kv_a_proj_with_mqa has 576
rows: 4.5 blocks); they take the scale of the block they start, as DeepSeek's `weight_dequant`,
vLLM and transformers' own FP8 matmul and `_dequantize_fp8_weight` do. (transformers 5.24's
`Fp8Dequantize`, the CPU path, instead derives the block from out // scale rows and so mis-scales
a matrix with more than one block along a partial dimension, or refuses it when that does not
divide.)

Which linears are quantized (`modules_to_not_convert`: lm_head, routers, ...) is read from the
tensors: a `<name>` with a `<name>_scale_inv` is dequantized, one without is read as is. Static
activation scales (`activation_scheme: "static"`) are not applied: the weights are served
dequantized with activations unquantized, as transformers does when it dequantizes at load.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from xlaserve.weights.formats.tensor_source import TensorSource

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
_FP8_DTYPES = (FP8_DTYPE, np.dtype(ml_dtypes.float8_e5m2))
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK_SIZE = (128, 128)
# Tensors only the FP8 matmul would read; hidden from the conversion with the scales.
_ACTIVATION_SCALE_SUFFIXES = (".activation_scale", "_activation_scale")
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
# Values dequantized per step (float32 scratch ~4 MB, in cache): a 4096x4096 block-scaled matrix
# (finiteness checked) takes 0.083 s to bfloat16 and 0.064 s to float32 in 256-row tiles against
# 0.129 s and 0.089 s whole, on a shared 2-core host, without the whole matrix's 64 MB temporaries.
_TILE_VALUES = 1 << 20
# Every float8_e4m3fn bit pattern as float32 (exact: e4m3 is a subset of float32); indexing it
# with the bytes gives what ml_dtypes' cast does, at the same speed.
_FP8_TO_FLOAT32 = np.arange(256, dtype=np.uint8).view(FP8_DTYPE).astype(np.float32)
_SUPPORTED_KEYS = {
    "quant_method", "activation_scheme", "weight_block_size", "fmt", "dequantize", "scale_fmt",
    "expert_dtype", "modules_to_not_convert", "ignored_layers", "modules_to_convert",
}


class Fp8Error(ValueError):
    """An FP8 tensor or quantization_config this loader does not handle."""


def check_fp8_config(quant: dict) -> tuple[int, int] | None:
    """The `weight_block_size` (None: per-channel or per-tensor scales) of an "fp8"
    quantization_config, after refusing in one line every field value whose tensors we do not
    decode: UE8M0 scales, FP4 experts (DeepSeek-V4), FP8 embedding tables, e5m2 weights."""
    unknown = sorted(set(quant) - _SUPPORTED_KEYS)
    if unknown:
        raise Fp8Error(f"fp8 quantization_config has fields this loader does not know: {unknown}")
    checks = (("activation_scheme", ("dynamic", "static"), "dynamic"),
              ("fmt", ("e4m3", "float8_e4m3fn"), "e4m3"),  # MiniMax-M2 writes the second
              ("scale_fmt", ("float",), "float"), ("expert_dtype", ("fp8",), "fp8"))
    for key, accepted, default in checks:
        value = quant.get(key, default)
        if isinstance(value, str):
            value = value.lower()
        if value not in accepted:
            raise Fp8Error(f"fp8 quantization_config.{key} {quant[key]!r} is not supported "
                           f"(only {' or '.join(map(repr, accepted))})")
    if quant.get("modules_to_convert"):
        raise Fp8Error(f"fp8 quantization_config.modules_to_convert {quant['modules_to_convert']!r} "
                       "(FP8 embedding tables) is not supported")
    # Absent is transformers' default (128, 128) (MiniMax-M2.5 writes none); null is per tensor.
    block = quant.get("weight_block_size", DEFAULT_BLOCK_SIZE)
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise Fp8Error(f"fp8 quantization_config.weight_block_size must be two positive integers, "
                       f"got {block!r}")
    return int(block[0]), int(block[1])


class Fp8Source:
    """`source` with every FP8 tensor that has a `<name>_scale_inv` dequantized into `dtype`, the
    scales (and static activation scales) hidden, every other tensor passed through as stored.
    `decode(weight, scale_inv, block_size, dtype, name)`: what such a tensor becomes instead of
    `dequantize_fp8`'s result (kept_quantized/fp8_kept.py reads its codes and scales apart)."""

    def __init__(self, source: TensorSource, block_size: tuple[int, int] | None, dtype,
                 decode=None):
        self._source = source
        self._block_size = block_size
        self._dtype = np.dtype(dtype)
        self._decode = decode or dequantize_fp8
        self._all = source.names()
        self._names = {n for n in self._all
                       if not n.endswith((SCALE_SUFFIX, *_ACTIVATION_SCALE_SUFFIXES))}

    def names(self) -> set[str]:
        return self._names

    def is_fp8(self, name: str) -> bool:
        """Whether `name` has a scale: an FP8 tensor that `get` decodes."""
        return name + SCALE_SUFFIX in self._all

    def get(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        array = self._source.get(name)
        scale_name = name + SCALE_SUFFIX
        if scale_name in self._all:
            return self._decode(array, self._source.get(scale_name), self._block_size,
                                self._dtype, name)
        if array.dtype in _FP8_DTYPES:
            raise Fp8Error(f"FP8 tensor {name!r} ({array.dtype.name}) has no {scale_name!r} "
                           "to dequantize it with")
        return array


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block_size: tuple[int, int] | None,
                   dtype, name: str = "FP8 tensor") -> np.ndarray:
    """float8_e4m3fn `weight` [..., out, in] times its `scale_inv` (block, per-channel or
    per-tensor; see the module docstring), rounded once from float32 into `dtype`. A value that
    is not finite in `dtype` (a NaN code, or a product beyond float16's range) is refused."""
    dtype = np.dtype(dtype)
    block_rows, block_cols = check_fp8_tensor(weight, scale_inv, block_size, name)
    rows, cols = weight.shape[-2:]
    flat_weight = weight.reshape(-1, rows, cols)
    flat_scale = np.asarray(scale_inv, np.float32).reshape(
        len(flat_weight), math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    out = np.empty(flat_weight.shape, dtype)
    tile = max(1, _TILE_VALUES // max(cols, 1))
    for matrix in range(len(flat_weight)):
        for r0 in range(0, rows, tile):
            r1 = min(r0 + tile, rows)
            scales = flat_scale[matrix, np.arange(r0, r1) // block_rows]  # [r1 - r0, scale cols]
            scales = np.repeat(scales, block_cols, axis=-1)[:, :cols]
            values = _FP8_TO_FLOAT32[np.asarray(flat_weight[matrix, r0:r1]).view(np.uint8)]
            with np.errstate(over="ignore"):  # refused just below, naming the value
                out[matrix, r0:r1] = values * scales
            if not np.isfinite(out[matrix, r0:r1]).all():
                lead = np.unravel_index(matrix, weight.shape[:-2]) if weight.ndim > 2 else ()
                _refuse_non_finite(out[matrix, r0:r1], values, scales, dtype, name, lead, r0)
    return out.reshape(weight.shape)


def check_fp8_tensor(weight: np.ndarray, scale_inv: np.ndarray, block_size: tuple[int, int] | None,
                     name: str) -> tuple[int, int]:
    """(rows, cols) of the block of `weight` [..., out, in] one scale of `scale_inv` covers, after
    refusing in one line a weight that is not float8_e4m3fn or not a matrix, a scale dtype we do
    not read, or a scale shape that fits no scheme."""
    if weight.dtype != FP8_DTYPE:
        raise Fp8Error(f"tensor {name!r} has a {name + SCALE_SUFFIX!r} but is {weight.dtype.name}, "
                       f"not float8_e4m3fn")
    if scale_inv.dtype not in _SCALE_DTYPES:
        raise Fp8Error(f"tensor {name + SCALE_SUFFIX!r} is {scale_inv.dtype.name}; FP8 scales are "
                       f"read as float32, bfloat16 or float16")
    if weight.ndim < 2:
        raise Fp8Error(f"FP8 tensor {name!r} has shape {list(weight.shape)}; a matrix was expected")
    return _scale_block(weight.shape, scale_inv.shape, block_size, name)


def _scale_block(weight_shape, scale_shape, block_size, name: str) -> tuple[int, int]:
    """(rows, cols) of the weight block one scale covers, from the scale's shape."""
    lead, (rows, cols) = tuple(weight_shape[:-2]), tuple(weight_shape[-2:])
    scale_shape = tuple(scale_shape)
    if scale_shape == lead + (1, 1) or (not lead and scale_shape in ((), (1,))):
        return rows, cols  # one scale per matrix
    if block_size is not None:
        block_rows, block_cols = block_size
        if scale_shape == lead + (math.ceil(rows / block_rows), math.ceil(cols / block_cols)):
            return block_rows, block_cols
    if scale_shape == lead + (rows, 1):
        return 1, cols  # one scale per output channel
    grid = ("" if block_size is None else
            f"{list(lead + (math.ceil(rows / block_size[0]), math.ceil(cols / block_size[1])))} "
            f"for weight_block_size {list(block_size)}, ")
    raise Fp8Error(f"tensor {name + SCALE_SUFFIX!r} has shape {list(scale_shape)}; for weight "
                   f"{list(weight_shape)} expected {grid}{list(lead + (rows, 1))} per channel or "
                   f"{list(lead + (1, 1))} per tensor")


def _refuse_non_finite(out: np.ndarray, values: np.ndarray, scales: np.ndarray, dtype: np.dtype,
                       name: str, lead: tuple, r0: int) -> None:
    row, col = (int(i) for i in np.argwhere(~np.isfinite(out))[0])
    where = ", ".join(str(int(i)) for i in (*lead, r0 + row, col))
    raise Fp8Error(f"FP8 tensor {name!r} at [{where}]: {values[row, col]} x scale "
                   f"{scales[row, col]} is not finite in {dtype.name}")
