"""MXFP4 expert weights of gpt-oss checkpoints, decoded exactly at load (host side, numpy).

gpt-oss stores each expert matrix as two tensors (everything else in the file is plain bfloat16):

  `<name>_blocks` uint8 [E, rows, cols/32, 16]  two FP4 (e2m1) codes per byte, the low nibble first
  `<name>_scales` uint8 [E, rows, cols/32]      one E8M0 exponent per group of 32 codes, biased by 127

`rows` is the matrix's output features: `gate_up_proj` is [E, 2*I, H/32, 16] and `down_proj`
[E, H, I/32, 16]. A value is FP4_VALUES[code] * 2**(scale - 127). Decoding transposes each expert,
as transformers' `convert_moe_packed_tensors` does, to the [E, in, out] orientation of its
GptOssExperts: `gate_up_proj` [E, H, 2*I] (gate and up interleaved: gate = [..., 0::2],
up = [..., 1::2]) and `down_proj` [E, I, H].

The values are transformers' bit for bit: it multiplies in float32 (torch.ldexp computes
`x * pow(2.0, e)` with the power in float32) and rounds once into the model's dtype. Every finite
product is m * 2**k with m in {1, 1.5}, so it is exact in float32 and bfloat16 for all scale bytes
below 253; float16 rounds away exponents below 2**-24 as transformers does. Scale bytes that make a
value overflow (253 and up for float32/bfloat16, 141 and up for float16, 255 is NaN in the OCP
spec) give inf/NaN in transformers; we refuse them instead.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from xlaserve.weights.formats.tensor_source import TensorSource

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
GROUP = 32  # values sharing one scale: 16 bytes of two codes
SCALE_BIAS = 127
DECODED_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float16))
# Rows (output features) of one expert decoded per step: the step's scratch (~1 MB) stays in cache
# and the transposed write goes out 256 values at a time. Transposing one gpt-oss gate_up expert
# ([5760, 2880] bfloat16) took 0.021 s in 256-row tiles against 0.096 s whole (numpy's strided copy
# of 2-byte values); a gpt-oss-20b gate_up (32 experts) then decodes in 3.3-8.7 s on a shared 2-core
# host against 34-38 s for transformers' convert_moe_packed_tensors (one torch thread).
_ROW_TILE = 256


class Mxfp4Error(ValueError):
    """An MXFP4 tensor this loader does not handle (the config is checked in quantization.py)."""


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype, name: str = "MXFP4 tensor") -> np.ndarray:
    """blocks uint8 [E, R, G, 16] and scales uint8 [E, R, G] -> [E, G*32, R] in `dtype`
    (bfloat16, float32 or float16), equal to transformers' `convert_moe_packed_tensors`.

    Decodes a tile of one expert's rows at a time from `blocks` (a memory map is read as it goes):
    one table lookup per packed byte gives both of its values already rounded to `dtype`."""
    dtype = _decoded_dtype(dtype, name)
    _check_packed(blocks, scales, name)
    experts, rows, groups, _ = blocks.shape
    table = _pair_table(dtype.name)
    out = np.empty((experts, groups * GROUP, rows), dtype)
    for expert in range(experts):
        scale, block = np.asarray(scales[expert]), blocks[expert]
        if int(scale.max(initial=0)) >= first_overflowing_scale(dtype.name):
            _refuse_overflow(np.asarray(block), scale, dtype, name, expert)
        for r0 in range(0, rows, _ROW_TILE):
            r1 = min(r0 + _ROW_TILE, rows)
            index = scale[r0:r1].astype(np.int32)[..., None] << 8 | block[r0:r1]
            # reshape(-1) puts the index in C order whatever the layout of `blocks`, so the view works.
            out[expert, :, r0:r1] = table[index.reshape(-1)].view(dtype).reshape(r1 - r0, groups * GROUP).T
    return out


def read_expert_weight(source: TensorSource, name: str, shape: tuple[int, int, int], dtype) -> np.ndarray:
    """The MXFP4 expert matrix `name` (e.g. `model.layers.0.mlp.experts.gate_up_proj`) decoded from
    `<name>_blocks` and `<name>_scales` into `dtype`, in transformers' orientation `shape` =
    [E, in, out]. (weights.expert_matrix chooses between this and a plain `<name>`.)"""
    experts, cols, rows = shape
    if cols % GROUP:
        raise Mxfp4Error(f"{name}: {cols} input features is not a multiple of the MXFP4 group of {GROUP}")
    packed = ((f"{name}_blocks", (experts, rows, cols // GROUP, GROUP // 2)),
              (f"{name}_scales", (experts, rows, cols // GROUP)))
    tensors = []
    for tensor_name, expected in packed:
        if tensor_name not in source.names():
            raise Mxfp4Error(f"checkpoint is missing tensor {tensor_name!r} (expected shape {list(expected)})")
        tensor = source.get(tensor_name)
        if tuple(tensor.shape) != expected:
            raise Mxfp4Error(f"tensor {tensor_name!r} has shape {list(tensor.shape)}, "
                             f"expected {list(expected)} from the config")
        tensors.append(tensor)
    return decode_mxfp4(*tensors, dtype, name=name)


def _decoded_dtype(dtype, name: str) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise Mxfp4Error(f"{name}: cannot decode MXFP4 into {dtype!r}") from None
    if dtype not in DECODED_DTYPES:
        raise Mxfp4Error(f"{name}: cannot decode MXFP4 into {dtype.name} "
                         f"(bfloat16, float32 or float16)")
    return dtype


def _check_packed(blocks: np.ndarray, scales: np.ndarray, name: str) -> None:
    for what, array in (("blocks", blocks), ("scales", scales)):
        if array.dtype != np.uint8:
            raise Mxfp4Error(f"{name}: MXFP4 {what} must be uint8, got {array.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != GROUP // 2:
        raise Mxfp4Error(f"{name}: MXFP4 blocks must be [experts, rows, groups, {GROUP // 2}], "
                         f"got {list(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise Mxfp4Error(f"{name}: MXFP4 scales {list(scales.shape)} do not match blocks "
                         f"{list(blocks.shape)} (expected {list(blocks.shape[:-1])})")


def _products(dtype_name: str) -> np.ndarray:
    """[256 scale bytes, 16 codes] -> the value in `dtype`, computed as transformers does: a
    float32 power of two (inf from 2**128), a float32 product, one rounding into the dtype."""
    with np.errstate(over="ignore", invalid="ignore"):
        powers = (2.0 ** (np.arange(256) - SCALE_BIAS)).astype(np.float32)
        return (powers[:, None] * FP4_VALUES[None, :]).astype(np.dtype(dtype_name))


@functools.lru_cache(maxsize=None)
def _pair_table(dtype_name: str) -> np.ndarray:
    """scale byte << 8 | packed byte -> both decoded values (low nibble first) as one unsigned
    integer of twice the dtype's width, so a single gather decodes a byte."""
    products = _products(dtype_name)
    byte = np.arange(256)
    pairs = np.stack([products[:, byte & 0xF], products[:, byte >> 4]], axis=-1)  # [256, 256, 2]
    wide = np.dtype(f"u{2 * pairs.dtype.itemsize}")
    return np.ascontiguousarray(pairs).view(wide).reshape(256 * 256)


@functools.lru_cache(maxsize=None)
def first_overflowing_scale(dtype_name: str) -> int:
    """The smallest scale byte at which some code decodes to inf or NaN in the dtype."""
    return int(np.argmax(~np.isfinite(_products(dtype_name).astype(np.float32)).all(axis=1)))


def _refuse_overflow(block: np.ndarray, scale: np.ndarray, dtype: np.dtype, name: str, expert: int) -> None:
    """Raise if a code of this expert ([rows, groups, 16] bytes) decodes to inf or NaN."""
    finite = np.isfinite(_products(dtype.name).astype(np.float32))  # [scale byte, code]
    codes = np.stack([block & 0xF, block >> 4], axis=-1).reshape(*scale.shape, GROUP)
    bad = ~finite[scale[..., None], codes]
    if bad.any():
        row, group, _ = np.argwhere(bad)[0]
        byte = int(scale[row, group])
        raise Mxfp4Error(f"{name}: MXFP4 scale byte {byte} (2**{byte - SCALE_BIAS}) overflows {dtype.name} "
                         f"at expert {expert}, row {row}, group {group}")
