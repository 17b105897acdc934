"""AWQ and GPTQ checkpoints (`quant_method: "awq"` / `"gptq"`, the most downloaded quantized
Hugging Face formats), dequantized to the serving dtype at load (host side, numpy): there are no
int4 kernels yet, so they serve at the memory and speed of their dequantized weights.

A quantized linear `<m>` (its float weight would be `<m>.weight`, [out, in]) stores instead:

  AWQ GEMM   `<m>.qweight` int32 [in, out/8]       8 nibbles a word along the OUTPUT dimension,
                                                   output column 8c + AWQ_ORDER[i] in bits 4i..4i+3
             `<m>.qzeros`  int32 [in/group, out/8] the same packing
             `<m>.scales`  fp16  [in/group, out]
  GPTQ       `<m>.qweight` int32 [in*bits/32, out] 32/bits codes a word along the INPUT dimension,
                                                   row (32/bits) r + j in bits j*bits.., in order
             `<m>.qzeros`  int32 [groups, out*bits/32] sequential along the output dimension
             `<m>.scales`  fp16  [groups, out]
             `<m>.g_idx`   int32 [in] (optional)   the group of each input row (act-order shuffles it)

and W[in, out] = (q - z) * s, with the group of row r from g_idx[r], else r // group_size. The
product of a small integer and an fp16/bf16 scale is exact in float32, so each value is rounded
once, into the serving dtype. Sources of the layouts (read, not copied):
- AWQ: AutoAWQ `awq/utils/packing_utils.py` (AWQ_ORDER [0, 2, 4, 6, 1, 3, 5, 7], `unpack_awq`,
  `reverse_awq_order`, `dequantize_gemm`: `(iweight - izeros) * scales`, groups repeated along in).
- GPTQ: GPTQModel `gptqmodel/nn_modules/qlinear/__init__.py` (`PackableQuantLinear.pack`,
  `dequantize_weight`: `scales[g_idx] * (weight - zeros[g_idx])`), and its
  `convert_gptq_v1_to_v2_format_module`: the v1 checkpoint format (AutoGPTQ, `checkpoint_format`
  "gptq", the default) stores every zero point minus one; "gptq_v2" stores them as they are.
  v1 is decoded per code, z = (stored + 1) mod 2^bits, as AutoGPTQ's own kernels do
  (`zeros = zeros + 1` then `& maxq`): the only exact inverse of the `- 1` for every zero.

Which linears are quantized (`modules_to_not_convert`, lm_head, MoE routers) is read from the
tensors: a `<m>.qweight` is dequantized into `<m>.weight`, every other tensor passes as stored.
"""
from __future__ import annotations

import logging

import ml_dtypes
import numpy as np

from xlaserve.weights.formats.tensor_source import TensorSource

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output column AWQ_ORDER[i]
AWQ_BITS = (4,)
GPTQ_BITS = (2, 4, 8)  # 3 bits packs codes across word boundaries: refused
GPTQ_FORMATS = ("gptq", "gptq_v2")
_PACKED = ("qweight", "qzeros", "scales", "g_idx")
_SCALE_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
# Values dequantized per step (float32 scratch ~16 MB, not the whole matrix's temporaries): a
# 4096x14336 matrix to bfloat16 takes 0.40 s (GPTQ, act-order) and 0.53 s (AWQ) on a shared 2-core
# host, so a 7B model's linears take about a minute.
_TILE_VALUES = 1 << 22


class PackedIntError(ValueError):
    """An AWQ or GPTQ tensor or quantization_config this loader does not decode."""


def check_awq_config(quant: dict) -> int:
    """The bits (4) of an "awq" quantization_config, after refusing in one line what we do not
    decode: another packing ("version"/"format" other than "gemm"), another width, no zeros."""
    version = str(quant.get("format") or quant.get("version") or "gemm").lower()
    if version != "gemm" or str(quant.get("backend", "")).lower() == "llm-awq":
        what = "backend 'llm-awq'" if version == "gemm" else f"version {version!r}"
        raise PackedIntError(f"awq quantization_config {what} is not supported (only AutoAWQ's "
                             "'gemm' packing, which GEMM, Marlin and ExLlama kernels all load)")
    bits = _bits(quant, "awq", AWQ_BITS)
    if quant.get("zero_point", True) is not True:
        raise PackedIntError(f"awq quantization_config.zero_point {quant['zero_point']!r} is not "
                             "supported (only true)")
    _group_size(quant, "awq")
    return bits


def check_gptq_config(quant: dict) -> int:
    """The bits (2, 4 or 8) of a "gptq" quantization_config, after refusing in one line what we
    do not decode: 3 bits, a kernel-specific format (marlin, bitblas, ...), per-module overrides."""
    bits = _bits(quant, "gptq", GPTQ_BITS)
    _gptq_format(quant)
    if quant.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise PackedIntError(f"gptq quantization_config.pack_dtype {quant['pack_dtype']!r} is not "
                             "supported (only int32)")
    if quant.get("dynamic"):  # GPTQModel's per-module bits and group sizes
        raise PackedIntError("gptq quantization_config.dynamic (per-module overrides) is not supported")
    _group_size(quant, "gptq")
    return bits


def log_dequantizing(method: str, bits: int, dtype) -> None:
    logger.info("%s int%d weights dequantized to %s at load (no int%d kernels yet)",
                method.upper(), bits, np.dtype(dtype).name, bits)


class PackedIntSource:
    """`source` with every `<m>.qweight` (and its qzeros, scales, g_idx) presented as the float
    `<m>.weight` [out, in] in `dtype`, the packed tensors hidden, every other tensor as stored."""

    def __init__(self, source: TensorSource, method: str, quant: dict, dtype):
        if method not in ("awq", "gptq"):
            raise ValueError(f"not a packed-int method: {method!r}")
        self._source, self._method, self._dtype = source, method, np.dtype(dtype)
        self._bits = check_awq_config(quant) if method == "awq" else check_gptq_config(quant)
        self._group_size = int(quant.get("group_size", 128))
        self._zeros_minus_one = method == "gptq" and _gptq_format(quant) == "gptq"
        names = source.names()
        self._modules = {n[:-len(".qweight")] for n in names if n.endswith(".qweight")}
        for name in sorted(names):
            module, _, suffix = name.rpartition(".")
            if suffix in _PACKED and module not in self._modules:
                # e.g. AWQ's ScaledActivation `act.scales` (MPT, Falcon, BLOOM): nothing applies them.
                raise PackedIntError(f"{method} tensor {name!r} has no {module + '.qweight'!r} "
                                     "to be decoded with")
            if method == "awq" and suffix == "g_idx":
                raise PackedIntError(f"awq tensor {name!r}: AWQ has no act-order g_idx")
        self._names = {n for n in names
                       if not (n.rpartition(".")[0] in self._modules and n.rpartition(".")[2] in _PACKED)}
        self._names |= {m + ".weight" for m in self._modules}

    @property
    def bits(self) -> int:
        return self._bits

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module not in self._modules:
            return self._source.get(name)
        get = self._source.get
        if self._method == "awq":
            weight = dequantize_awq(get(module + ".qweight"), get(module + ".qzeros"),
                                    get(module + ".scales"), self._group_size, self._dtype, module)
        else:
            g_idx = get(module + ".g_idx") if module + ".g_idx" in self._source.names() else None
            weight = dequantize_gptq(get(module + ".qweight"), get(module + ".qzeros"),
                                     get(module + ".scales"), g_idx, self._bits, self._group_size,
                                     self._zeros_minus_one, self._dtype, module)
        return weight.T  # [in, out] -> a Linear's [out, in]


def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [rows, cols] -> uint8 [rows * 32/bits, cols]: code j of word [r, c] is row
    (32/bits) r + j (GPTQ's qweight)."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = (packed.view(np.uint32)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.astype(np.uint8).reshape(-1, packed.shape[1])


def unpack_cols(packed: np.ndarray, bits: int, order=None) -> np.ndarray:
    """int32 [rows, cols] -> uint8 [rows, cols * 32/bits]: code i of word [r, c] is column
    (32/bits) c + order[i] (GPTQ's qzeros in order; AWQ's qweight and qzeros with AWQ_ORDER)."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = ((packed.view(np.uint32)[:, :, None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)
    if order is not None:
        codes = codes[:, :, np.argsort(order)]  # natural column k sits in nibble order.index(k)
    return codes.reshape(packed.shape[0], -1)


def dequantize_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int,
                   dtype, name: str = "awq") -> np.ndarray:
    """W [in, out] in `dtype` of an AutoAWQ GEMM-packed 4-bit linear (module docstring)."""
    _check_dtypes(name, qweight, qzeros, scales)
    rows, out = qweight.shape[0], qweight.shape[1] * 8
    group_size = rows if group_size == -1 else group_size
    groups = -(-rows // group_size)
    _check_shape(name, "scales", scales, (groups, out))
    _check_shape(name, "qzeros", qzeros, (groups, out // 8))
    zeros = unpack_cols(qzeros, 4, AWQ_ORDER)
    g_idx = np.arange(rows) // group_size
    return _dequantize(lambda r0, r1: unpack_cols(qweight[r0:r1], 4, AWQ_ORDER), zeros, scales,
                       g_idx, rows, 1, dtype, name)


def dequantize_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray,
                    g_idx: np.ndarray | None, bits: int, group_size: int, zeros_minus_one: bool,
                    dtype, name: str = "gptq") -> np.ndarray:
    """W [in, out] in `dtype` of a GPTQ-packed linear (module docstring); `zeros_minus_one` for
    the v1 checkpoint format."""
    _check_dtypes(name, qweight, qzeros, scales, g_idx)
    per_word = 32 // bits
    rows, out = qweight.shape[0] * per_word, qweight.shape[1]
    groups = 1 if group_size == -1 else -(-rows // group_size)
    _check_shape(name, "scales", scales, (groups, out))
    _check_shape(name, "qzeros", qzeros, (groups, -(-out // per_word)))
    zeros = unpack_cols(qzeros, bits)[:, :out]
    if zeros_minus_one:
        zeros = (zeros + 1) & ((1 << bits) - 1)
    if g_idx is None:
        g_idx = np.arange(rows) // (rows if group_size == -1 else group_size)
    else:
        _check_shape(name, "g_idx", g_idx, (rows,))
        if g_idx.size and not (0 <= g_idx.min() and g_idx.max() < groups):
            raise PackedIntError(f"gptq tensor {name + '.g_idx'!r} holds groups {int(g_idx.min())}.."
                                 f"{int(g_idx.max())}, outside the {groups} of its scales")
    return _dequantize(lambda r0, r1: unpack_rows(qweight[r0 // per_word:r1 // per_word], bits),
                       zeros, scales, g_idx.astype(np.int64), rows, per_word, dtype, name)


def _dequantize(codes, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray, rows: int,
                row_step: int, dtype, name: str) -> np.ndarray:
    """(codes(r0, r1) - zeros[g_idx]) * scales[g_idx] over tiles of input rows, each value the
    exact float32 product rounded once into `dtype`; a value not finite there is refused."""
    dtype = np.dtype(dtype)
    scales = scales.astype(np.float32)  # exact: fp16 and bf16 are subsets of float32
    if not np.isfinite(scales).all():
        raise PackedIntError(f"tensor {name + '.scales'!r} holds a value that is not finite")
    zeros = zeros.astype(np.float32)
    out = np.empty((rows, scales.shape[1]), dtype)
    tile = max(row_step, _TILE_VALUES // max(scales.shape[1], 1) // row_step * row_step)
    for r0 in range(0, rows, tile):
        r1 = min(r0 + tile, rows)
        group = g_idx[r0:r1]
        with np.errstate(over="ignore"):  # refused just below, naming the value
            out[r0:r1] = (codes(r0, r1).astype(np.float32) - zeros[group]) * scales[group]
        if not np.isfinite(out[r0:r1]).all():
            row, col = (int(i) for i in np.argwhere(~np.isfinite(out[r0:r1]))[0])
            raise PackedIntError(f"tensor {name!r} at input row {r0 + row}, output column {col}: "
                                 f"scale {scales[group[row], col]} is not finite in {dtype.name}")
    return out


def _check_dtypes(name, qweight, qzeros, scales, g_idx=None) -> None:
    for suffix, array in (("qweight", qweight), ("qzeros", qzeros)):
        if array.dtype != np.int32 or array.ndim != 2:
            raise PackedIntError(f"tensor {name + '.' + suffix!r} is {array.dtype.name} "
                                 f"{list(array.shape)}; packed int32 [rows, cols] was expected")
    if scales.dtype not in _SCALE_DTYPES:
        raise PackedIntError(f"tensor {name + '.scales'!r} is {scales.dtype.name}; scales are "
                             "read as float16 or bfloat16")
    if g_idx is not None and g_idx.dtype.kind not in "iu":
        raise PackedIntError(f"tensor {name + '.g_idx'!r} is {g_idx.dtype.name}, not integer")


def _check_shape(name: str, suffix: str, array: np.ndarray, expected: tuple) -> None:
    if tuple(array.shape) != tuple(expected):
        raise PackedIntError(f"tensor {name + '.' + suffix!r} has shape {list(array.shape)}, "
                             f"expected {list(expected)} for its qweight and group_size")


def _bits(quant: dict, method: str, accepted: tuple) -> int:
    bits = quant.get("bits", 4)
    if bits not in accepted or isinstance(bits, bool):
        raise PackedIntError(f"{method} quantization_config.bits {bits!r} is not supported "
                             f"(only {' or '.join(map(str, accepted))})")
    return int(bits)


def _group_size(quant: dict, method: str) -> int:
    size = quant.get("group_size", 128)
    if not (isinstance(size, int) and not isinstance(size, bool) and (size > 0 or size == -1)):
        raise PackedIntError(f"{method} quantization_config.group_size must be a positive integer "
                             f"or -1, got {size!r}")
    return size


def _gptq_format(quant: dict) -> str:
    fmt = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
    if fmt not in GPTQ_FORMATS:
        raise PackedIntError(f"gptq quantization_config checkpoint_format {fmt!r} is not supported "
                             f"(only {' or '.join(map(repr, GPTQ_FORMATS))})")
    return fmt
