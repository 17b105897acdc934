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
With activations="q8" the Q8 GEMM (q8_gemm_cpu.cc) quantizes x per block as llama.cpp does and
multiplies integers: GGUF formats in the file's layout or, for blocks of 32 and i8_row (W8A8),
the interleaved "x8" layouts (`interleave_x8`: groups of 8 rows, the same bytes reordered),
which only it reads.
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
Q8_TARGET_NAME = "xlaserve_q8_gemm_cpu"
_SOURCE = Path(__file__).with_name("quantized_gemm_cpu.cc")
_Q8_SOURCE = Path(__file__).with_name("q8_gemm_cpu.cc")
# How x meets the weights: "q8" quantizes x per block and multiplies integers as llama.cpp does
# (q8_gemm_cpu.cc: GGUF formats, and i8_row interleaved), "float32" multiplies x as is by the
# decoded weights.
ACTIVATIONS = ("q8", "float32")

# name -> (weights per block, bytes per block); an i8_row row also starts with its 4-byte scale.
FORMATS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22),
           "q5_1": (32, 24), "q4_k": (256, 144), "q6_k": (256, 210), "i8_row": (1, 1)}
# The kernel's format codes (quantized_blocks.h): ggml's type ids; 256 for ours.
_CODES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q6_k": 14,
          "i8_row": 256}
_ROW_HEADER = {"i8_row": 4}

# The blocks of 32 in their interleaved layouts (q8_interleaved.h): "<format>x8", groups of 8 rows
# whose blocks' fields are side by side, for the Q8 GEMM. A block's fields in order: (start,
# bytes) of d, m, qh, then of the quantized values, which are interleaved 4 bytes at a time.
_BLOCK_FIELDS = {"q8_0": ((0, 2),), "q4_0": ((0, 2),), "q4_1": ((0, 2), (2, 2)),
                 "q5_0": ((0, 2), (2, 4)), "q5_1": ((0, 2), (2, 2), (4, 4))}
X8 = {f"{fmt}x8": fmt for fmt in (*_BLOCK_FIELDS, "i8_row")}  # interleaved layout -> its format
_CODES.update({name: _CODES[fmt] + 1024 for name, fmt in X8.items()})


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of K weights in format `fmt` (an x8 layout: its format's)."""
    fmt = X8.get(fmt, fmt)
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


@functools.cache
def load_q8(march: str | None = None) -> str:
    """Builds and registers the Q8 GEMM for `march` (once; raises KernelUnavailable; None: the
    other kernels' build, build.default_march); returns its custom call's name."""
    name = Q8_TARGET_NAME if march is None else f"{Q8_TARGET_NAME}_{march}"
    register(_Q8_SOURCE, "XlaserveQ8Gemm", name, march)
    return name


def _check_rows(rows: jax.Array, fmt: str, k: int, layer: int) -> None:
    expected = row_bytes(fmt, k)
    if rows.dtype != jnp.uint8 or rows.ndim not in (2, 3) or rows.shape[-1] != expected:
        raise ValueError(f"{fmt} weights with K={k} are uint8 [(L,) N, {expected}]; got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    layers = rows.shape[0] if rows.ndim == 3 else 1
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is out of range for {layers} stacked weight(s)")


def quantized_matmul(x: jax.Array, rows: jax.Array, *, fmt: str, k: int, layer: int = 0,
                     activations: str = "float32", march: str | None = None) -> jax.Array:
    """x [M, K] (float32, or bfloat16 widened here) @ W.T -> float32 [M, N], W given as its rows
    in format `fmt` [N, row_bytes], or a stack [L, N, row_bytes] of which `layer` is used.
    `activations` "q8": x quantized per block as llama.cpp quantizes it for `fmt` (Q8_0, Q8_1
    or Q8_K) and multiplied in integers (q8_blocks.h): GGUF formats, and i8_row in its
    interleaved layout (i8_rowx8, K a multiple of 32); the only one of the "x8" layouts. `march`: the Q8 GEMM's build (build.register;
    tests run its AVX2 and portable paths with "x86-64-v3" and "x86-64-v2")."""
    _check_rows(rows, fmt, k, layer)
    if x.ndim != 2 or x.shape[1] != k or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"quantized_matmul takes float32 or bfloat16 x [M, {k}]; got "
                         f"{x.dtype} {tuple(x.shape)}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r} is not one of {ACTIVATIONS}")
    if activations == "q8" and fmt == "i8_row":
        raise ValueError("i8_row takes q8 activations in its interleaved layout (i8_rowx8) only")
    if fmt == "i8_rowx8" and k % 32:
        raise ValueError(f"i8_rowx8 takes K a multiple of 32; K={k}")
    if activations != "q8" and fmt in X8:
        raise ValueError(f"{fmt} (interleaved) is multiplied with q8 activations only")
    out = jax.ShapeDtypeStruct((x.shape[0], rows.shape[-2]), jnp.float32)
    if activations == "q8":
        call = jax.ffi.ffi_call(load_q8(march), out)
    else:
        load()
        call = jax.ffi.ffi_call(MATMUL_TARGET_NAME, out)
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
    if fmt in X8:  # each id's group of 8 rows, put back in GGUF's layout, then its row
        n = rows.shape[-2]
        ids = jnp.clip(jnp.where(ids < 0, ids + n, ids), 0, n - 1).astype(jnp.int32)
        matrix = rows[layer] if rows.ndim == 3 else rows
        groups = matrix.reshape(n // 8, 8, -1)[ids // 8]  # [T, 8, row_bytes]
        picked = jnp.take_along_axis(deinterleave_x8(groups, X8[fmt], jnp),
                                     (ids % 8)[:, None, None], axis=1)[:, 0]
        return quantized_rows(picked, jnp.arange(ids.shape[0], dtype=jnp.int32), fmt=X8[fmt],
                              k=k)
    load()
    call = jax.ffi.ffi_call(ROWS_TARGET_NAME, jax.ShapeDtypeStruct((ids.shape[0], k), jnp.float32))
    return call(rows, ids.astype(jnp.int32), format=np.int64(_CODES[fmt]), layer=np.int64(layer))


def interleave_x8(rows, fmt: str, xp=np):
    """Rows [..., N, row_bytes] of a GGUF format of blocks of 32, or i8_row (K a multiple of 32),
    in its "x8" layout (N a multiple of 8; q8_interleaved.h): the same bytes, each group of 8 rows
    reordered. `xp`: numpy or jax.numpy."""
    lead, (n, size) = rows.shape[:-2], rows.shape[-2:]
    if n % 8:
        raise ValueError(f"the x8 layout takes rows in groups of 8; N={n}")
    if fmt == "i8_row":  # the 8 scales, then the values' words row by row
        if (size - 4) % 32:
            raise ValueError(f"i8_rowx8 takes K a multiple of 32; K={size - 4}")
        groups = rows.reshape(*lead, n // 8, 8, size)
        words = groups[..., 4:].reshape(*lead, n // 8, 8, -1, 4)
        return xp.concatenate([groups[..., :4].reshape(*lead, n // 8, 32),
                               xp.swapaxes(words, -3, -2).reshape(*lead, n // 8, -1)],
                              axis=-1).reshape(rows.shape)
    fields, block_bytes = _BLOCK_FIELDS[fmt], FORMATS[fmt][1]
    blocks = xp.swapaxes(rows.reshape(*lead, n // 8, 8, size // block_bytes, block_bytes), -3, -2)
    values_at = sum(length for _, length in fields)
    parts = [blocks[..., start:start + length].reshape(*blocks.shape[:-2], 8 * length)
             for start, length in fields]
    values = blocks[..., values_at:].reshape(*blocks.shape[:-1], (block_bytes - values_at) // 4, 4)
    parts.append(xp.swapaxes(values, -3, -2).reshape(*blocks.shape[:-2], -1))
    return xp.concatenate(parts, axis=-1).reshape(rows.shape)


def deinterleave_x8(rows, fmt: str, xp=np):
    """interleave_x8's inverse: rows in `fmt`'s "x8" layout back to GGUF's (or i8_row's)."""
    lead, (n, size) = rows.shape[:-2], rows.shape[-2:]
    if fmt == "i8_row":
        groups = rows.reshape(*lead, n // 8, 8 * size)
        scales = groups[..., :32].reshape(*lead, n // 8, 8, 4)
        words = xp.swapaxes(groups[..., 32:].reshape(*lead, n // 8, -1, 8, 4), -3, -2)
        return xp.concatenate([scales, words.reshape(*lead, n // 8, 8, size - 4)],
                              axis=-1).reshape(rows.shape)
    fields, block_bytes = _BLOCK_FIELDS[fmt], FORMATS[fmt][1]
    groups = rows.reshape(*lead, n // 8, size // block_bytes, 8 * block_bytes)
    parts, at = [], 0
    for _, length in fields:
        parts.append(groups[..., at:at + 8 * length].reshape(*groups.shape[:-1], 8, length))
        at += 8 * length
    values_bytes = block_bytes - at // 8
    values = groups[..., at:].reshape(*groups.shape[:-1], values_bytes // 4, 8, 4)
    parts.append(xp.swapaxes(values, -3, -2).reshape(*groups.shape[:-1], 8, values_bytes))
    blocks = xp.concatenate(parts, axis=-1)  # [..., N / 8, blocks, 8, block_bytes]
    return xp.swapaxes(blocks, -3, -2).reshape(rows.shape)


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
    if fmt in X8:
        return dequantize(deinterleave_x8(rows, X8[fmt]), X8[fmt], k)
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
    if fmt in X8:
        return interleave_x8(random_rows(X8[fmt], n, k, rng), X8[fmt])
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
