"""The attention's inputs from the fused qkv projection on the CPU: q, k and v split out, RoPE on q
and k, rounded to the cache's dtype, in one pass spread over XLA's thread pool
(`qkv_rope_cpu.cc` as an XLA FFI custom call).

    q, k, v = qkv_rope(qkv, cos, sin, out_dtype)
    # qkv float32 [T, kv_heads, group + 2, D] (the qkv matmul's output), cos / sin [T, D/2]
    # -> q [T, kv_heads * group, D], k and v [T, kv_heads, D]

The math is `transformer.apply_rope`'s (rotate-half) in float32 with one rounding at the end.
XLA's CPU backend ran it as four or five single-threaded fusions per layer.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from xlaserve.native.build import register

_SOURCE = Path(__file__).with_name("qkv_rope_cpu.cc")
_TARGET = "xlaserve_qkv_rope_cpu"


@functools.cache
def load() -> None:
    """Builds and registers the custom call (once; raises KernelUnavailable)."""
    register(_SOURCE, "XlaserveQkvRope", _TARGET)


def qkv_rope(qkv: jax.Array, cos: jax.Array, sin: jax.Array, out_dtype=jnp.float32):
    if qkv.ndim != 4 or qkv.shape[2] < 3 or qkv.shape[3] % 2 or cos.shape != sin.shape or \
            cos.shape != (qkv.shape[0], qkv.shape[3] // 2) or jnp.dtype(out_dtype) not in (
                jnp.float32, jnp.bfloat16):
        raise ValueError(f"qkv_rope takes qkv [T, kv_heads, group + 2, D] (D even), cos and sin "
                         f"[T, D/2] and a float32 or bfloat16 output; got {qkv.shape}, {cos.shape}, "
                         f"{sin.shape}, {out_dtype}")
    load()
    tokens, kv_heads, width, d = qkv.shape
    heads = jax.ShapeDtypeStruct((tokens, kv_heads, d), out_dtype)
    call = jax.ffi.ffi_call(_TARGET, (
        jax.ShapeDtypeStruct((tokens, kv_heads * (width - 2), d), out_dtype), heads, heads))
    return call(qkv.astype(jnp.float32), cos.astype(jnp.float32), sin.astype(jnp.float32))
