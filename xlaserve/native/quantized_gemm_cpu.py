"""Matmuls on the CPU over weights kept quantized: `quantized_gemm_cpu.cc` as XLA FFI custom calls.

    rows = tensor.data.reshape(n, row_bytes("q4_k", k))  # a GGUF tensor's bytes, as in the file
    y = quantized_matmul(x, rows, fmt="q4_k", k=k)       # x [M, K] @ W.T -> float32 [M, N]
    y = quantized_matmul(x, stacked, fmt="q4_k", k=k, layer=i)  # stacked [L, N, row_bytes]: no copy
    e = quantized_rows(rows, ids, fmt="q8_0", k=k)       # W[ids] float32 [T, K]: embedding lookup
    rows = i8_rows(values, scales)                       # int8 [N, K], float32 [N] -> our "i8_row"

A weight W [N, K] (used as y = x @ W.T) stays in memory as `rows`, uint8 [N, row_bytes]: row n is
output n's K weights in consecutive blocks of its format (`FORMATS`):
- GGUF's q8_0, q4_0, q4_1, q5_0, q5_1 (blocks of 32) and q4_k, q6_k (blocks of 256; a Q4_K_M file
  is Q4_K and Q6_K tensors, and Q5_0 where K is not a multiple of 256), exactly the bytes of the
  file's [N, K] tensor;
- "i8_row", ours for --quantization int8: each row a float32 scale then K int8 values (per output
  channel symmetric int8), any K.
The kernel decodes blocks to float32 weights equal to gguf.quants.dequantize's and multiplies
float32 x by them (x is not quantized), so y is x @ dequantize(W).T up to float32 summation order.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.native.build import register

MATMUL_TARGET_NAME = "xlaserve_quantized_gemm_cpu"
ROWS_TARGET_NAME = "xlaserve_quantized_rows_cpu"
_SOURCE = Path(__file__).with_name("quantized_gemm_cpu.cc")

# name -> (weights per block, bytes per block); an i8_row row also starts with its 4-byte scale.
FORMATS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22),
           "q5_1": (32, 24), "q4_k": (256, 144), "q6_k": (256, 210), "i8_row": (1, 1)}
# The kernel's format codes (quantized_blocks.h): ggml's type ids; 256 for ours.
_CODES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q6_k": 14,
          "i8_row": 256}
_ROW_HEADER = {"i8_row": 4}


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of K weights in format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized weight format {fmt!r}; known: {', '.join(FORMATS)}")
    block, size = FORMATS[fmt]
    if k <= 0 or k % block:
        raise ValueError(f"{fmt} rows hold whole blocks of {block} weights; K={k} is not a "
                         f"positive multiple of {block}")
    return _ROW_HEADER.get(fmt, 0) + k // block * size


@functools.cache
def load() -> None:
    """Builds and registers both custom calls (once; raises KernelUnavailable)."""
    register(_SOURCE, "XlaserveQuantizedGemm", MATMUL_TARGET_NAME)
    register(_SOURCE, "XlaserveQuantizedRows", ROWS_TARGET_NAME)


def _check_rows(rows: jax.Array, fmt: str, k: int, layer: int) -> None:
    expected = row_bytes(fmt, k)
    if rows.dtype != jnp.uint8 or rows.ndim not in (2, 3) or rows.shape[-1] != expected:
        raise ValueError(f"{fmt} weights with K={k} are uint8 [(L,) N, {expected}]; got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    layers = rows.shape[0] if rows.ndim == 3 else 1
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is out of range for {layers} stacked weight(s)")


def quantized_matmul(x: jax.Array, rows: jax.Array, *, fmt: str, k: int,
                     layer: int = 0) -> jax.Array:
    """x [M, K] (float32, or bfloat16 widened here) @ W.T -> float32 [M, N], W given as its rows
    in format `fmt` [N, row_bytes], or a stack [L, N, row_bytes] of which `layer` is used."""
    _check_rows(rows, fmt, k, layer)
    if x.ndim != 2 or x.shape[1] != k or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"quantized_matmul takes float32 or bfloat16 x [M, {k}]; got "
                         f"{x.dtype} {tuple(x.shape)}")
    load()
    call = jax.ffi.ffi_call(MATMUL_TARGET_NAME,
                            jax.ShapeDtypeStruct((x.shape[0], rows.shape[-2]), jnp.float32))
    return call(x.astype(jnp.float32), rows, format=np.int64(_CODES[fmt]), layer=np.int64(layer))


def quantized_rows(rows: jax.Array, ids: jax.Array, *, fmt: str, k: int,
                   layer: int = 0) -> jax.Array:
    """W[ids] dequantized, float32 [T, K], for ids [T] (negative ids count from the end, others are
    clamped to [0, N), as jnp indexing does); only those rows are decoded."""
    _check_rows(rows, fmt, k, layer)
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"quantized_rows takes integer ids [T]; got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    if rows.shape[-2] == 0:
        raise ValueError("quantized_rows: the weight has no rows to index")
    load()
    call = jax.ffi.ffi_call(ROWS_TARGET_NAME, jax.ShapeDtypeStruct((ids.shape[0], k), jnp.float32))
    return call(rows, ids.astype(jnp.int32), format=np.int64(_CODES[fmt]), layer=np.int64(layer))


def i8_rows(values: jax.Array, scales: jax.Array) -> jax.Array:
    """The "i8_row" format: int8 values [..., N, K] and float32 scales [..., N] (w = scale * value)
    -> uint8 [..., N, 4 + K], each row its scale's 4 bytes (little-endian) then its values."""
    if values.dtype != jnp.int8 or scales.shape != values.shape[:-1]:
        raise ValueError(f"i8_rows takes int8 values [..., N, K] and scales [..., N]; got "
                         f"{values.dtype} {tuple(values.shape)}, {tuple(scales.shape)}")
    # The machine's byte order, which the kernel reads: little-endian on x86 and ARM.
    scale_bytes = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)
    return jnp.concatenate([scale_bytes, jax.lax.bitcast_convert_type(values, jnp.uint8)], axis=-1)


def dequantize(rows: np.ndarray, fmt: str, k: int) -> np.ndarray:
    """The float32 weights [N, K] of rows [N, row_bytes] in numpy: gguf.quants.dequantize for GGUF
    formats (the kernel's reference), scale * values for i8_row."""
    rows = np.asarray(rows)
    _check_rows(rows, fmt, k, 0)
    if fmt == "i8_row":
        scales = np.ascontiguousarray(rows[:, :4]).view(np.float32)
        return scales * rows[:, 4:].view(np.int8).astype(np.float32)
    from gguf import GGMLQuantizationType, quants
    return quants.dequantize(rows, GGMLQuantizationType(_CODES[fmt])).reshape(rows.shape[0], k)


# Where each format keeps its float16 scales (d, and Q4_1's and Q5_1's m, Q4_K's dmin) in a block.
_HALF_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
                 "q4_k": (0, 2), "q6_k": (208,)}


def random_rows(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights in format `fmt`, uint8 [N, row_bytes]: every byte random (all quantized
    values, Q5's high bits, K-quants' packed scales) except the float scales, drawn from
    [1e-3, 1e-2) so that no weight is inf or NaN. For tests and benchmarks (gguf-py cannot
    quantize the K-quants)."""
    size = row_bytes(fmt, k)
    rows = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if fmt == "i8_row":
        rows[:, :4] = rng.uniform(1e-3, 1e-2, (n, 1)).astype(np.float32).view(np.uint8)
        return rows
    block, block_bytes = FORMATS[fmt]
    blocks = rows.reshape(n * (k // block), block_bytes)
    for offset in _HALF_OFFSETS[fmt]:
        scales = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    return rows
