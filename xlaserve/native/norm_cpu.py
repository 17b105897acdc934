"""RMSNorm of the residual stream on the CPU, and the residual add before it, in one pass over the
rows spread over XLA's thread pool: `norm_cpu.cc` as XLA FFI custom calls.

    normed = rms_norm(x, scale, eps, out_dtype)            # scale * x / rms(x)
    x, normed = add_rms_norm(x, delta, scale, eps, out_dtype)  # x + delta, and its norm

x and delta are float32 [T, H] (the residual stream and a sublayer's output); `out_dtype` is
float32, or bfloat16 where the next matmul takes bfloat16 x (the k-pair GEMM). The math is
`layers.rms_norm`'s: float32 throughout, the scale widened to float32, one rounding at the
end. XLA's CPU backend ran a norm as three or four single-threaded kernels (the add, a YNNPACK
sum of squares, the rsqrt, the scaling), ~90 us each at 128 rows, ~5 ms of a decode step.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.native.build import register

_SOURCE = Path(__file__).with_name("norm_cpu.cc")
_NORM, _ADD_NORM = "xlaserve_rms_norm_cpu", "xlaserve_add_rms_norm_cpu"


@functools.cache
def load() -> None:
    """Builds and registers both custom calls (once; raises KernelUnavailable)."""
    register(_SOURCE, "XlaserveRmsNorm", _NORM)
    register(_SOURCE, "XlaserveAddRmsNorm", _ADD_NORM)


def _check(x: jax.Array, scale: jax.Array, out_dtype) -> None:
    if x.ndim != 2 or scale.shape != (x.shape[1],) or jnp.dtype(out_dtype) not in (
            jnp.float32, jnp.bfloat16) or scale.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"RMSNorm takes x [T, H], scale [H] (float32 or bfloat16) and a float32 "
                         f"or bfloat16 output; got {x.shape}, {scale.shape} {scale.dtype}, {out_dtype}")


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, out_dtype=jnp.float32) -> jax.Array:
    _check(x, scale, out_dtype)
    load()
    call = jax.ffi.ffi_call(_NORM, jax.ShapeDtypeStruct(x.shape, out_dtype))
    return call(x.astype(jnp.float32), scale, eps=np.float32(eps))


def add_rms_norm(x: jax.Array, delta: jax.Array, scale: jax.Array, eps: float,
                 out_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """(x + delta, rms_norm(x + delta)); the sum is written over x's buffer (x is the residual
    stream, dead after the add)."""
    _check(x, scale, out_dtype)
    if delta.shape != x.shape:
        raise ValueError(f"delta {delta.shape} does not match x {x.shape}")
    load()
    call = jax.ffi.ffi_call(
        _ADD_NORM, (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape, out_dtype)),
        input_output_aliases={0: 0})
    return call(x.astype(jnp.float32), delta.astype(jnp.float32), scale, eps=np.float32(eps))
