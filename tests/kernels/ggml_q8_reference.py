"""ggml's integer dot products in numpy: the Q8 GEMM's reference (native/q8_gemm_cpu.cc), written
from ggml's block formats (ggml-common.h), its x86 code's quantization of activations
(quantize_row_q8_0 / q8_1 in ggml-cpu/arch/x86/quants.c, quantize_row_q8_K_ref in
ggml-quants.c) and its vec_dot_*_q8_* (ggml-cpu/quants.c): the integer sums exactly, their
scaling in float64 from the float32 factors the kernel uses."""
from __future__ import annotations

import numpy as np

F32 = np.float32


def half(values) -> np.ndarray:
    """float32 rounded to float16 and back (round to nearest even), as ggml stores d and s."""
    return np.asarray(values, F32).astype(np.float16).astype(F32)


def quantize_blocks32(x: np.ndarray):
    """Q8_0 / Q8_1 of x [M, K]: (q int32 [M, K / 32, 32], d [M, K / 32] (float16-rounded),
    s [M, K / 32] = float16(d * sum(q)), with d = amax / 127 unrounded there)."""
    blocks = np.asarray(x, F32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    d = (amax / F32(127)).astype(F32)
    inverse = np.where(amax != 0, F32(127) / np.where(amax != 0, amax, F32(1)), F32(0)).astype(F32)
    q = np.rint(blocks * inverse[..., None]).astype(np.int32)  # half to even, as _mm256_round_ps
    return q, half(d), half(d * q.sum(-1).astype(F32))


def quantize_blocks_k(x: np.ndarray):
    """Q8_K of x [M, K]: (q int32 [M, K / 256, 256], d float32 [M, K / 256]); max is the first
    x of largest |x|, iscale = -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale;
    a block of zeros has d = 0 and q = 0."""
    blocks = np.asarray(x, F32).reshape(x.shape[0], -1, 256)
    first = np.abs(blocks).argmax(-1)
    largest = np.take_along_axis(blocks, first[..., None], -1)[..., 0]
    zero = largest == 0
    iscale = np.where(zero, F32(0), F32(-127) / np.where(zero, F32(1), largest)).astype(F32)
    q = np.minimum(127, np.rint(blocks * iscale[..., None])).astype(np.int32)
    d = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), iscale)).astype(F32)
    return q, d


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(F32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)


def _fifth_bits(blocks: np.ndarray, at: int) -> np.ndarray:
    qh = np.ascontiguousarray(blocks[..., at:at + 4]).view(np.uint32)[..., 0]
    return ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4


def weight_blocks32(rows: np.ndarray, fmt: str):
    """(values int32 [N, K / 32, 32] as the dot multiplies them, d [N, K / 32], m or None);
    xlaserve's i8_row (a float32 scale, then K int8: --quantization int8) as Q8_0 blocks that
    share the row's scale."""
    if fmt == "i8_row":
        values = rows[:, 4:].view(np.int8).astype(np.int32).reshape(rows.shape[0], -1, 32)
        scale = np.ascontiguousarray(rows[:, :4]).view(np.float32)
        return values, np.broadcast_to(scale, values.shape[:2]), None
    size = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}[fmt]
    b = rows.reshape(rows.shape[0], -1, size)
    d = _halves(b, 0)
    if fmt == "q8_0":
        return b[..., 2:].view(np.int8).astype(np.int32), d, None
    if fmt == "q4_0":
        return _nibbles(b[..., 2:]) - 8, d, None
    if fmt == "q4_1":
        return _nibbles(b[..., 4:]), d, _halves(b, 2)
    if fmt == "q5_0":
        return (_nibbles(b[..., 6:]) | _fifth_bits(b, 2)) - 16, d, None
    return _nibbles(b[..., 8:]) | _fifth_bits(b, 4), d, _halves(b, 2)


def _q4_k(b: np.ndarray):
    """Q4_K blocks [N, B, 144] -> (q [N, B, 256] 0..15, scales [N, B, 8], mins [N, B, 8], d, dmin):
    ggml's get_scale_min_k4 and its sub-block j = low (j even) or high nibbles of bytes 32 (j / 2)."""
    s = b[..., 4:16].astype(np.int32)
    scales = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 32).astype(np.int32)
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*b.shape[:-1], 256)
    return q, scales, mins, _halves(b, 0), _halves(b, 2)


def _q6_k(b: np.ndarray):
    """Q6_K blocks [N, B, 210] -> (q [N, B, 256] in -32..31, scales [N, B, 16], d): ggml's
    dequantize_row_q6_K's order (halves of 128, each 4 x 32 from ql's nibbles and qh's 2-bit pairs)."""
    ql, qh = b[..., :128].astype(np.int32), b[..., 128:192].astype(np.int32)
    out = []
    for h in range(2):
        low, high = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        for t in range(4):
            nib = low[..., 32 * (t % 2):32 * (t % 2) + 32]
            nib = nib & 15 if t < 2 else nib >> 4
            out.append((nib | ((high >> (2 * t)) & 3) << 4) - 32)
    scales = b[..., 192:208].view(np.int8).astype(np.int32)
    return np.concatenate(out, -1), scales, _halves(b, 208)


def q8_matmul(x: np.ndarray, rows: np.ndarray, fmt: str):
    """(y float64 [M, N], bound [M, N]): ggml's dot product of x's Q8 blocks with GGUF rows
    [N, row_bytes], and the sum of the |products| it is made of, each scaled (float32 summation,
    in any order, errs by ~1e-7 of it; the kernels, as ggml's, sum lanes of partial sums)."""
    m, k = x.shape
    if fmt in ("q4_k", "q6_k"):
        q, d = quantize_blocks_k(x)
        b = rows.reshape(rows.shape[0], k // 256, -1)
        if fmt == "q4_k":
            w, scales, mins, dw, dmin = _q4_k(b)
            groups, size = 8, 32
            offsets = dmin[None].astype(np.float64) * d.astype(np.float64)[:, None, :] * np.einsum(
                "nbj,mbj->mnb", mins.astype(np.int64), q.reshape(m, -1, 8, 32).sum(-1))
            scales = scales.astype(np.int64)
        else:
            w, scales, dw = _q6_k(b)
            groups, size, offsets = 16, 16, 0.0
        products = np.einsum("nbgc,mbgc->mnbgc", w.reshape(*w.shape[:2], groups, size),
                             q.reshape(m, -1, groups, size))  # int32: |w q| < 2^13
        factor = (dw[None] * d[:, None, :]).astype(np.float64)
        scaled = factor * (products.sum(-1, dtype=np.int64) * scales[None]).sum(-1)
        bound = np.abs(factor) * (np.abs(products).sum(-1, dtype=np.int64)
                                  * np.abs(scales[None])).sum(-1)
        return (scaled - offsets).sum(-1), (bound + np.abs(offsets)).sum(-1)
    q, d, s = quantize_blocks32(x)
    w, dw, mw = weight_blocks32(rows, fmt)
    products = np.einsum("nbc,mbc->mnbc", w, q)
    factor = (dw[None] * d[:, None, :]).astype(np.float64)
    scaled = factor * products.sum(-1, dtype=np.int64)
    offsets = 0.0 if mw is None else mw[None].astype(np.float64) * s[:, None, :]
    bound = np.abs(factor) * np.abs(products).sum(-1, dtype=np.int64) + np.abs(offsets)
    return (scaled + offsets).sum(-1), bound.sum(-1)
