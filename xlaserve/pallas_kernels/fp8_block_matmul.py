"""y = x @ W for an FP8 weight with one scale per (K block, output column), as a Pallas GPU kernel
(Triton lowering): the matmul of FP8 checkpoints with 128x128 block scales (DeepSeek-V3, Qwen3
"-FP8"), kept in FP8 on GPUs with FP8 tensor cores (model/weight_types/fp8_weights.py).

    values  float8_e4m3fn [N, K]   (K contiguous: the layout FP8 MMAs read)
    scales  float32 [K // block_k, N]
    W[k, n] = values[n, k] * scales[k // block_k, n]

x [T, K] is quantized per token and K block (1 x block_k groups: scale = max |group| / 448, 1 for
a group of zeros), as DeepSeek-V3's and vLLM's block FP8 kernels do; then each program of the grid
(T / block_t, N / block_n) walks the K blocks, multiplying a [block_t, block_k] FP8 tile of x by a
[block_n, block_k] FP8 tile of W on the tensor cores and adding the float32 product, times x's
group scales and W's column scales, into a float32 accumulator. So each weight byte is read once,
dequantized nowhere, and every K block's partial sum is promoted to float32 (an FP8 MMA accumulates
in less than float32: DeepSeek-V3's report promotes every 128 values for that reason).

XLA alone did not do this (deviceless H100 compile, [4096 x 14336] weight, 256 rows): a
dequantize of the weight in front of a bfloat16 dot was not fused into the GEMM (it wrote a
117 MB bfloat16 copy: 312 MB moved against bfloat16's 134 MB), and a per-K-block batched FP8 dot
wrote [K/128, T, N] float32 partial sums (1.96 GB moved, 940 MB of temporaries).

Tile sizes are vLLM's defaults for this kernel (block_n 128, 4 warps) with fewer rows per program
for decode batches and narrower columns where 128-wide ones would leave an H100's 132 SMs idle;
they are not tuned on hardware. `interpret=True` runs the kernel on the CPU (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.pallas_kernels.gpu_tiles import BLOCK_N_CHOICES, column_tile

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def supports(n: int, k: int, block_k: int) -> str | None:
    """Why the kernel cannot multiply a [K, N] weight of `block_k` K blocks; None if it can."""
    if block_k < 16 or block_k & (block_k - 1):
        return f"K blocks of {block_k} (the kernel needs a power of two of at least 16)"
    if k % block_k:
        return f"K = {k} is not a whole number of {block_k}-wide blocks"
    if n % BLOCK_N_CHOICES[-1]:
        return f"N = {n} is not a multiple of {BLOCK_N_CHOICES[-1]}"
    return None


def quantize_groups(x: jax.Array, block_k: int) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (float8_e4m3fn [T, K], float32 scales [T, K // block_k]): each group of
    `block_k` values divided by max |group| / 448 (1 for a group of zeros), rounded to nearest."""
    rows, k = x.shape
    groups = x.astype(jnp.float32).reshape(rows, k // block_k, block_k)
    amax = jnp.max(jnp.abs(groups), axis=2)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    quantized = jnp.clip(groups / scales[:, :, None], -FP8_MAX, FP8_MAX).astype(FP8)
    return quantized.reshape(rows, k), scales


def block_fp8_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, block_k: int, *,
                     interpret: bool = False) -> jax.Array:
    """float32 [T, N] = x [T, K] @ W (module docstring)."""
    rows, k = x.shape
    n = values.shape[0]
    problem = supports(n, k, block_k)
    if problem is not None or values.shape != (n, k) or scales.shape != (k // block_k, n):
        raise ValueError(f"block FP8 matmul of x {x.shape}, values {values.shape}, scales "
                         f"{scales.shape}, K blocks of {block_k}: {problem or 'shapes disagree'}")
    block_t = min(64, max(16, 1 << (rows - 1).bit_length()))
    padded = -(-rows // block_t) * block_t
    block_n = column_tile(n, padded // block_t)
    x_fp8, x_scales = quantize_groups(x, block_k)
    x_fp8 = jnp.pad(x_fp8, ((0, padded - rows), (0, 0)))
    x_scales = jnp.pad(x_scales, ((0, padded - rows), (0, 0))).T  # [K blocks, T]: a row per step
    k_blocks = k // block_k
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, k_blocks=k_blocks),
        out_shape=jax.ShapeDtypeStruct((padded, n), jnp.float32),
        grid=(padded // block_t, n // block_n),
        in_specs=[pl.BlockSpec((block_t, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k_blocks, block_t), lambda i, j: (0, i)),
                  pl.BlockSpec((block_n, k), lambda i, j: (j, 0)),
                  pl.BlockSpec((k_blocks, block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_t, block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(x_fp8, x_scales, values, scales)
    return out[:rows]




def _kernel(x_ref, x_scales_ref, w_ref, w_scales_ref, out_ref, *, block_k, k_blocks):
    def step(kb, acc):
        x = x_ref[:, pl.ds(kb * block_k, block_k)]
        w = w_ref[:, pl.ds(kb * block_k, block_k)]
        partial = lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        return acc + partial * x_scales_ref[kb, :][:, None] * w_scales_ref[kb, :][None, :]

    out_ref[...] = lax.fori_loop(0, k_blocks, step, jnp.zeros(out_ref.shape, jnp.float32))
