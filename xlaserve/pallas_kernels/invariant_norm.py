"""RMSNorm in which a row's result does not depend on the other rows: the norms of
--enable-deterministic-inference on TPU and GPU (runtime/executor/kernels.py), with the contract
of `layers.rms_norm_xla` and `layers.add_rms_norm_xla`.

Why not XLA's: a fused row reduction's order follows the whole shape (measured on the CPU: a
[M, 576] mean's rows differ in the last bits between M = 1 and M = 23), and XLA's GPU reduction
emitter picks its tiling from it too. Here rows go in blocks of a fixed `block_rows`, each row's
sum of squares is taken over its own values in one order: the TPU form reduces the whole row in
one block (Mosaic: shape-invariant numerics), the GPU form walks the row in power-of-two chunks
(Triton's tensors are powers of two), adding each chunk's sum in turn.

The arithmetic is the XLA form's: float32 throughout, `scale * (x * rsqrt(mean(x * x) + eps))`,
rounded to `out_dtype` at the end. `interpret` runs it on the CPU (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

NAME = "invariant_rms_norm"
BLOCK_ROWS = {"tpu": 32, "gpu": 16}  # 32: a sublane tile of every dtype up to 8-bit ones
GPU_CHUNK = 256  # the most columns a GPU program reduces at once


def gpu_chunk(hidden: int) -> int | None:
    """The GPU form's chunk: the largest power of two dividing `hidden`, at most GPU_CHUNK and at
    least 16 (Triton's smallest tile); None where there is none."""
    chunk = min(hidden & -hidden, GPU_CHUNK)
    return chunk if chunk >= 16 else None


def supports(hidden: int, platform: str) -> str | None:
    """Why the kernel cannot normalize rows of `hidden` on `platform`; None if it can."""
    if platform not in BLOCK_ROWS:
        return f"the batch-invariant RMSNorm runs on TPU and GPU, not on {platform}"
    if platform == "gpu" and gpu_chunk(hidden) is None:
        return f"rows of {hidden} (the GPU batch-invariant RMSNorm needs a multiple of 16)"
    return None


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, out_dtype, *, platform: str,
             interpret=False) -> jax.Array:
    """`out_dtype` [T, H] = RMSNorm(x [T, H]) * scale [H]."""
    return _call(x, None, scale, eps, out_dtype, platform, interpret)[1]


def add_rms_norm(x: jax.Array, delta: jax.Array, scale: jax.Array, eps: float, out_dtype, *,
                 platform: str, interpret=False) -> tuple[jax.Array, jax.Array]:
    """(x + delta, `rms_norm` of it): the residual stream's add and the next norm."""
    return _call(x, delta, scale, eps, out_dtype, platform, interpret)


def _call(x, delta, scale, eps, out_dtype, platform, interpret):
    rows, hidden = x.shape
    problem = supports(hidden, platform)
    if problem is not None:
        raise ValueError(problem)
    block = BLOCK_ROWS[platform]
    padded = -(-rows // block) * block
    pad = lambda a: jnp.pad(a, ((0, padded - rows), (0, 0)))
    inputs = [pad(x)] + ([] if delta is None else [pad(delta)])
    total_dtype = x.dtype if delta is None else jnp.result_type(x, delta)
    out_shape = [jax.ShapeDtypeStruct((padded, hidden), out_dtype)]
    if delta is not None:
        out_shape.append(jax.ShapeDtypeStruct((padded, hidden), total_dtype))
    row_spec = pl.BlockSpec((block, hidden), lambda i: (i, 0))
    if platform == "tpu":
        body = functools.partial(_tpu_kernel, eps=eps, has_delta=delta is not None)
        params = pltpu.CompilerParams(dimension_semantics=("parallel",))
    else:
        body = functools.partial(_gpu_kernel, eps=eps, has_delta=delta is not None,
                                 chunk=gpu_chunk(hidden))
        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    outs = pl.pallas_call(
        body, name=NAME, out_shape=out_shape, grid=(padded // block,),
        in_specs=[row_spec] * len(inputs) + [pl.BlockSpec((1, hidden), lambda i: (0, 0))],
        out_specs=[row_spec] * len(out_shape), compiler_params=params, interpret=interpret,
    )(*inputs, scale.reshape(1, hidden))
    normed = outs[0][:rows]
    return (outs[1][:rows] if delta is not None else None), normed


def _tpu_kernel(*refs, eps, has_delta):
    """The whole row in one block: one reduction over its lanes."""
    if has_delta:
        x_ref, delta_ref, scale_ref, out_ref, total_ref = refs
        total = (x_ref[...] + delta_ref[...]).astype(total_ref.dtype)
        total_ref[...] = total
        x = total.astype(jnp.float32)  # normalized as stored, as the XLA form does
    else:
        x_ref, scale_ref, out_ref = refs
        x = x_ref[...].astype(jnp.float32)
    mean = jnp.sum(x * x, axis=1, keepdims=True) / x.shape[1]
    normed = x * lax.rsqrt(mean + eps)
    out_ref[...] = (scale_ref[...].astype(jnp.float32) * normed).astype(out_ref.dtype)


def _gpu_kernel(*refs, eps, has_delta, chunk):
    """The row in `chunk`-wide slices: the sum of squares slice by slice, then the output."""
    if has_delta:
        x_ref, delta_ref, scale_ref, out_ref, total_ref = refs
    else:
        (x_ref, scale_ref, out_ref), delta_ref, total_ref = refs, None, None
    rows, hidden = x_ref.shape
    chunks = hidden // chunk

    def row_slice(c, store: bool):
        """The slice's values (x + delta, rounded as stored) in float32; recomputed where they
        are needed rather than read back: a Triton program's stores are not visible to its
        other threads' loads without a barrier."""
        span = pl.ds(c * chunk, chunk)
        if delta_ref is None:
            return x_ref[:, span].astype(jnp.float32)
        total = (x_ref[:, span] + delta_ref[:, span]).astype(total_ref.dtype)
        if store:
            total_ref[:, span] = total
        return total.astype(jnp.float32)

    def square_sum(c, acc):
        x = row_slice(c, store=False)
        return acc + jnp.sum(x * x, axis=1)

    total = lax.fori_loop(0, chunks, square_sum, jnp.zeros((rows,), jnp.float32))
    inverse = lax.rsqrt(total / hidden + eps)[:, None]

    def write(c, carry):
        span = pl.ds(c * chunk, chunk)
        x = row_slice(c, store=True)
        out_ref[:, span] = (scale_ref[:, span].astype(jnp.float32) * (x * inverse)
                            ).astype(out_ref.dtype)
        return carry

    lax.fori_loop(0, chunks, write, 0)


def for_platform(platform: str, interpret: bool = False):
    """(rms_norm, add_rms_norm) bound to `platform` (interpreted on the CPU with `interpret`)."""
    mode = (pltpu.InterpretParams() if platform == "tpu" else True) if interpret else False
    return (functools.partial(rms_norm, platform=platform, interpret=mode),
            functools.partial(add_rms_norm, platform=platform, interpret=mode))
