"""The experts' grouped matmul over MXFP4 weights, decoded inside the kernel (Pallas, Triton
lowering; sm80 and later): gpt-oss's experts as its checkpoint stores them, four bits a weight.

Weights come in the checkpoint's layout (weights/formats/mxfp4.py): `blocks` uint8 [E, N, K/32, 16],
two e2m1 codes a byte (the low nibble first: value 2j then 2j + 1 of each 32-value group), and
`scales` uint8 [E, N, K/32], one E8M0 exponent a group (2**(scale - 127)); N the output features, K
the input ones. A program multiplies one visit's rows (grouped_matmul_gpu.py's grid of column tiles
and visits) by one column tile of its expert: each K step reads [block_n, block_k / 2] bytes and
their scales, decodes the low and the high nibbles into two [block_n, block_k / 2] bfloat16 tiles
(exact: every finite MXFP4 value is m * 2**k with m in {0.5, 1, 1.5}), and multiplies them by the
even and the odd columns of x's K step (a strided load), so no interleave is needed. float32
accumulation; the output in `out_dtype`.

Why: bfloat16 experts are four times the bytes. gpt-oss-120b's experts decoded at load are
234 GB, which needs several GPUs; in MXFP4 the whole model is ~65 GB, one H100's. Hopper has no
FP4 tensor-core instruction, so the codes are decoded to bfloat16 in registers and the dot is
bfloat16's, at a quarter of the weight bytes from DRAM (a decode step's cost).

`interpret=True` runs it on the CPU (tests). model/moe.py multiplies experts held as
`model/weight_types/mxfp4_experts.Mxfp4Experts` with it (`Kernels.mxfp4_grouped_matmul`), which
`--quantization mxfp4` loads (weights/kept_quantized/mxfp4_kept.py). On an H200 (2026-11-27) it
matched ragged_dot on the decoded experts but took 2.1-2.7x the bf16 kernel's time on them
(docs/tpu-gpu.md, "Mixtures of experts").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.pallas_kernels.grouped_matmul_gpu import (plan_visits, visit_rows,
                                                       zero_rows_past_the_groups)

NAME = "grouped_matmul_mxfp4"  # in the compiled program: "grouped_matmul_mxfp4_m16"
GROUP = 32  # values sharing one scale (weights/formats/mxfp4.py)
SCALE_BIAS = 127
BLOCK_K_CHOICES = (128, 64)  # K per step: whole groups, and >= 32 columns per nibble half


def supports(k: int, n: int) -> str | None:
    """Why the kernel cannot multiply [K, N] MXFP4 experts; None if it can."""
    if k % BLOCK_K_CHOICES[-1] or n % 16:
        return (f"MXFP4 experts of {k} x {n} (the GPU kernel needs K a multiple of "
                f"{BLOCK_K_CHOICES[-1]} and N of 16)")
    return None


def grouped_matmul_mxfp4(x: jax.Array, blocks: jax.Array, scales: jax.Array,
                         group_sizes: jax.Array, out_dtype=jnp.float32, *,
                         block_m: int | None = None, block_n: int | None = None,
                         block_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
                         interpret: bool = False) -> jax.Array:
    """x [M, K] sorted by group, times each group's expert decoded from `blocks` uint8
    [E, N, K/32, 16] and `scales` uint8 [E, N, K/32]: out_dtype [M, N], rows past the groups'
    total zero (model/grouped_matmul.py's contract)."""
    rows, k = x.shape
    groups, n, k_groups, half_group = blocks.shape
    if k_groups * GROUP != k or half_group != GROUP // 2 or scales.shape != blocks.shape[:3]:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not make "
                         f"[{groups}, {n}] experts of {k} input features")
    problem = supports(k, n)
    if problem is not None:
        raise ValueError(problem)
    block_k = block_k or next(b for b in BLOCK_K_CHOICES if k % b == 0)
    plan = plan_visits(x.astype(jnp.bfloat16), group_sizes, groups, n, block_m, block_n)
    out = pl.pallas_call(
        functools.partial(_kernel, groups=groups, block_m=plan.block_m, block_k=block_k),
        out_shape=jax.ShapeDtypeStruct((rows + plan.block_m, n), out_dtype),
        grid=plan.grid,
        in_specs=plan.in_specs + [
            pl.BlockSpec((groups, plan.block_n, k_groups, half_group), lambda c, v: (0, c, 0, 0)),
            pl.BlockSpec((groups, plan.block_n, k_groups), lambda c, v: (0, c, 0))],
        out_specs=plan.out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"{NAME}_m{plan.block_m}",
    )(*plan.visit_arrays, plan.x, blocks, scales)
    return out[:rows]


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """4-bit e2m1 codes (int32) -> float32: sign, 2 exponent bits, 1 mantissa bit; exponent 0 is
    the subnormal 0 / 0.5 (weights/formats/mxfp4.py's FP4_VALUES)."""
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).astype(jnp.float32)
    power = jnp.where(exponent == 1, 1.0, jnp.where(exponent == 2, 2.0, 4.0))
    magnitude = jnp.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * power)
    return jnp.where((codes >> 3) == 1, -magnitude, magnitude)


def scale_values(scale_bytes: jax.Array) -> jax.Array:
    """E8M0 bytes (int32) -> 2**(byte - 127) in float32, exactly: the byte is the exponent field
    (byte 0, 2**-127, comes out 0: a float32 subnormal no gpt-oss scale uses)."""
    return lax.bitcast_convert_type(scale_bytes << 23, jnp.float32)


def _kernel(group_ref, start_ref, end_ref, x_ref, blocks_ref, scales_ref, out_ref, *, groups,
            block_m, block_k):
    group, start, rows_here, target = visit_rows(group_ref, start_ref, end_ref, out_ref, block_m)
    block_n = out_ref.shape[1]
    k_groups_per_step = block_k // GROUP
    half = block_k // 2

    @pl.when(group < groups)
    def _multiply():
        def step(kb, acc):
            k0 = kb * block_k
            x_even = x_ref[pl.ds(start, block_m), pl.ds(k0, half, stride=2)]
            x_odd = x_ref[pl.ds(start, block_m), pl.ds(k0 + 1, half, stride=2)]
            k_groups = pl.ds(kb * k_groups_per_step, k_groups_per_step)
            packed = blocks_ref[group, :, k_groups, :].astype(jnp.int32)  # [bn, kg, 16]
            scale = scale_values(scales_ref[group, :, k_groups].astype(jnp.int32))[..., None]
            for codes, x in ((packed & 15, x_even), (packed >> 4, x_odd)):
                w = (decode_e2m1(codes) * scale).reshape(block_n, half).astype(jnp.bfloat16)
                acc += lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
            return acc

        acc = lax.fori_loop(0, x_ref.shape[1] // block_k, step,
                            jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(target, acc.astype(out_ref.dtype), mask=rows_here)

    zero_rows_past_the_groups(group, groups, target, rows_here)
