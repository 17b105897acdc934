"""Tiny AWQ and GPTQ checkpoints, packed as AutoAWQ and GPTQModel/AutoGPTQ write them, and the
float64 values they stand for. Test-only: the server dequantizes
(xlaserve/weights/formats/awq_gptq.py) and never quantizes. The packing here is written from the
writers' side, word by word, so that it checks the server's vectorized unpacking rather than
repeating it:
- AWQ (AutoAWQ `awq/utils/packing_utils.py` AWQ_ORDER, and its `WQLinear_GEMM.from_linear`):
  word c of a row holds output columns 8c + [0, 2, 4, 6, 1, 3, 5, 7] in nibbles 0..7.
- GPTQ (GPTQModel `PackableQuantLinear.pack`): word r of a column holds input rows
  (32/bits) r + j in bits j*bits..; qzeros word c holds columns (32/bits) c + j; the v1 format
  stores each zero minus one, wrapped to `bits` bits (AutoGPTQ's `zeros -= 1`)."""
from __future__ import annotations

import re

import numpy as np

from tests.weights.fp8_writer import _read, _write

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantize(weight: np.ndarray, g_idx: np.ndarray, groups: int, bits: int, sym: bool):
    """float [in, out] -> (codes uint8 [in, out], zeros int [groups, out], float16 scales
    [groups, out]) by min/max per group and column, the scale rounded to float16 before the codes
    are taken (as GPTQ's and AWQ's quantizers do)."""
    maxq = (1 << bits) - 1
    weight = np.asarray(weight, np.float64)
    scales = np.empty((groups, weight.shape[1]), np.float16)
    zeros = np.empty((groups, weight.shape[1]), np.int64)
    for group in range(groups):
        rows = weight[g_idx == group]
        if sym:
            scale = np.maximum(np.abs(rows).max(0), 1e-6) * 2 / maxq
            zero = np.full(weight.shape[1], (maxq + 1) // 2)
        else:
            low, high = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
            scale = np.maximum(high - low, 1e-6) / maxq
            zero = np.clip(np.round(-low / scale.astype(np.float16)), 0, maxq)
        scales[group], zeros[group] = scale, zero
    s, z = scales.astype(np.float64)[g_idx], zeros[g_idx]
    codes = np.clip(np.round(weight / s) + z, 0, maxq).astype(np.uint8)
    return codes, zeros, scales


def reference(codes, zeros, scales, g_idx) -> np.ndarray:
    """float64 W [in, out] = (q - z) * s, each row with its group's zero and scale."""
    return (codes.astype(np.float64) - zeros[g_idx]) * scales.astype(np.float64)[g_idx]


def _word(values: list[np.ndarray], bits: int) -> np.ndarray:
    word = np.zeros(values[0].shape, np.uint64)
    for position, value in enumerate(values):
        word |= value.astype(np.uint64) << np.uint64(position * bits)
    return word.astype(np.uint32).view(np.int32)


def pack_awq(codes: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(qweight [in, out/8], qzeros [groups, out/8]) in AutoAWQ's GEMM order."""
    def pack(matrix):
        return np.stack([_word([matrix[:, 8 * c + AWQ_ORDER[i]] for i in range(8)], 4)
                         for c in range(matrix.shape[1] // 8)], axis=1)
    return pack(codes), pack(zeros)


def pack_gptq(codes: np.ndarray, zeros: np.ndarray, bits: int, v1: bool) -> tuple[np.ndarray, np.ndarray]:
    """(qweight [in*bits/32, out], qzeros [groups, out*bits/32]); `v1`: zeros stored minus one."""
    per_word = 32 // bits
    stored = (zeros - 1) & ((1 << bits) - 1) if v1 else zeros
    qweight = np.stack([_word([codes[per_word * r + j] for j in range(per_word)], bits)
                        for r in range(codes.shape[0] // per_word)])
    qzeros = np.stack([_word([stored[:, per_word * c + j] for j in range(per_word)], bits)
                       for c in range(stored.shape[1] // per_word)], axis=1)
    return qweight, qzeros


def act_order_g_idx(rows: int, group_size: int, rng) -> np.ndarray:
    """GPTQ's desc_act g_idx: rows quantized in a shuffled order, group k // group_size of the
    k-th row quantized."""
    g_idx = np.empty(rows, np.int32)
    g_idx[rng.permutation(rows)] = np.arange(rows) // group_size
    return g_idx


def write_checkpoint(plain: str, directory: str, quantization_config: dict, seed: int = 0) -> dict:
    """Quantize every `*_proj.weight` of the float32 checkpoint in `plain` into `directory` in the
    format of `quantization_config` (awq; gptq with its bits, group_size, sym, desc_act,
    checkpoint_format), experts' included; MoE routers (`mlp.gate.weight`) stay float, as both
    writers leave them. A module whose name contains an entry of `modules_to_not_convert` stays
    float too: AutoAWQ's substring rule (`exclude_layers_to_not_quantize`), so its MoE default
    ["gate"] also leaves every expert's `gate_proj` float. Returns {name: float64 dequantized
    value [out, in]}."""
    rng = np.random.default_rng(seed)
    tensors, config = _read(plain)
    method = quantization_config["quant_method"]
    bits, group_size = quantization_config.get("bits", 4), quantization_config.get("group_size", 128)
    not_converted = quantization_config.get("modules_to_not_convert") or []
    dequantized = {}
    for name, value in list(tensors.items()):
        if not QUANTIZED.search(name) or any(key in name for key in not_converted):
            continue
        weight = value.T  # a Linear's [out, in] -> [in, out]
        rows = weight.shape[0]
        size = rows if group_size == -1 else group_size
        if quantization_config.get("desc_act"):
            g_idx = act_order_g_idx(rows, size, rng)
        else:
            g_idx = (np.arange(rows) // size).astype(np.int32)
        codes, zeros, scales = quantize(weight, g_idx, -(-rows // size), bits,
                                        sym=quantization_config.get("sym", method == "gptq"))
        module = name[:-len(".weight")]
        del tensors[name]
        if method == "awq":
            qweight, qzeros = pack_awq(codes, zeros)
        else:
            v1 = quantization_config.get("checkpoint_format", "gptq") == "gptq"
            qweight, qzeros = pack_gptq(codes, zeros, bits, v1)
            tensors[module + ".g_idx"] = g_idx
        tensors.update({module + ".qweight": qweight, module + ".qzeros": qzeros,
                        module + ".scales": scales})
        dequantized[name] = reference(codes, zeros, scales, g_idx).T
    _write(directory, tensors, {**config, "quantization_config": quantization_config})
    return dequantized
