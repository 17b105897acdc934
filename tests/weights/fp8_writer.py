"""Tiny FP8 checkpoints in the Hugging Face "fp8" format (transformers' FineGrainedFP8, as
DeepSeek-V3 and the Qwen3 "-FP8" models ship them): every attention and MLP projection
(`*_proj.weight`, experts included) float8_e4m3fn with a float32 `weight_scale_inv`, the rest
(embeddings, norms, routers, lm_head) float32. Test-only: the server dequantizes
(xlaserve/weights/formats/fp8.py) and never quantizes."""
from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np

FP8_MAX = np.float32(448.0)  # float8_e4m3fn's largest value
QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantize_fp8(weight: np.ndarray, scheme) -> tuple[np.ndarray, np.ndarray]:
    """[..., out, in] float32 -> (float8_e4m3fn weight, float32 scale_inv) as transformers'
    `Fp8Quantize` computes them (in float32: scale = 448 / max |block|, 1 where the block is
    zero; scale_inv = 1 / scale; the weight times scale, clamped, rounded to e4m3), extended to
    partial edge blocks (which `Fp8Quantize` leaves unquantized). `scheme`: [bm, bn] blocks
    (scale_inv [..., ceil(out/bm), ceil(in/bn)]), "channel" ([..., out, 1]) or "tensor" ([] for
    a matrix, [..., 1, 1] for a stack)."""
    weight = np.asarray(weight, np.float32)
    *lead, rows, cols = weight.shape
    block_rows, block_cols = _block(scheme, rows, cols)
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    padded = np.zeros((*lead, grid[0] * block_rows, grid[1] * block_cols), np.float32)
    padded[..., :rows, :cols] = weight
    blocks = padded.reshape(*lead, grid[0], block_rows, grid[1], block_cols)
    max_abs = np.abs(blocks).max(axis=(-3, -1))
    # torch computes `448 / t` as `t.reciprocal() * 448`: two roundings, reproduced here.
    scale = np.where(max_abs > 0, (np.float32(1) / np.where(max_abs > 0, max_abs, 1)) * FP8_MAX, 1)
    scale = scale.astype(np.float32)
    scale_inv = (np.float32(1) / scale).astype(np.float32)
    scaled = np.clip(blocks * scale[..., :, None, :, None], -FP8_MAX, FP8_MAX)
    quantized = scaled.reshape(padded.shape)[..., :rows, :cols].astype(ml_dtypes.float8_e4m3fn)
    return quantized, scale_inv.reshape(()) if scheme == "tensor" and not lead else scale_inv


def dequantize_reference(quantized: np.ndarray, scale_inv: np.ndarray, scheme) -> np.ndarray:
    """float32 values of an FP8 weight, written independently of the server's tiled code: every
    scale repeated over its whole block, the product taken in float32."""
    *lead, rows, cols = quantized.shape
    block_rows, block_cols = _block(scheme, rows, cols)
    scale = np.asarray(scale_inv, np.float32).reshape(*lead, -(-rows // block_rows), -(-cols // block_cols))
    full = np.repeat(np.repeat(scale, block_rows, axis=-2), block_cols, axis=-1)[..., :rows, :cols]
    return quantized.astype(np.float32) * full


def write_fp8_checkpoint(plain: str, directory: str, schemes, quantization_config: dict) -> dict:
    """Quantize the float32 checkpoint in `plain` (tests/tiny_models.make_tiny_checkpoint) into
    `directory`: each `*_proj.weight` with `schemes(name)` (see quantize_fp8), config.json with
    `quantization_config`. Returns {name: float32 dequantized value} of every quantized weight."""
    import torch

    tensors, config = _read(plain)
    dequantized = {}
    for name, value in list(tensors.items()):
        if QUANTIZED.search(name):
            quantized, scale_inv = quantize_fp8(value, schemes(name))
            tensors[name] = torch.from_numpy(quantized.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = scale_inv
            dequantized[name] = dequantize_reference(quantized, scale_inv, schemes(name))
    _write(directory, tensors, {**config, "quantization_config": quantization_config})
    return dequantized


def write_dequantized_checkpoint(plain: str, directory: str, dequantized: dict) -> None:
    """`plain` with the quantized weights replaced by their float32 dequantized values: what
    transformers runs as the reference (its own CPU dequantization mis-scales partial blocks)."""
    tensors, config = _read(plain)
    _write(directory, {**tensors, **dequantized}, config)


def _block(scheme, rows: int, cols: int) -> tuple[int, int]:
    return {"channel": (1, cols), "tensor": (rows, cols)}.get(scheme) or tuple(scheme)


def _read(plain: str) -> tuple[dict, dict]:
    from safetensors.numpy import load_file

    tensors = {}
    for name in sorted(n for n in os.listdir(plain) if n.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(plain, name)))
    with open(os.path.join(plain, "config.json")) as f:
        return tensors, json.load(f)


def _write(directory: str, tensors: dict, config: dict) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {name: value if isinstance(value, torch.Tensor)
               else torch.from_numpy(np.ascontiguousarray(value)) for name, value in tensors.items()}
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
