"""The gated MLP's activation on the CPU, `silu(gate) * up`, spread over XLA's thread pool:
`swiglu_cpu.cc` as an XLA FFI custom call.

    out = swiglu(gate_up, out_dtype)   # gate_up float32 [T, 2, I] -> out [T, I]

`out_dtype` is float32, or bfloat16 where the down matmul takes bfloat16 x (the k-pair GEMM);
the math is float32 with one rounding at the end, as XLA's `silu(g) * u` then a convert. XLA's
CPU backend ran it single-threaded, ~110 us per layer of a 128-row decode step.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from xlaserve.native.build import register

_SOURCE = Path(__file__).with_name("swiglu_cpu.cc")
_TARGET = "xlaserve_swiglu_cpu"


@functools.cache
def load() -> None:
    """Builds and registers the custom call (once; raises KernelUnavailable)."""
    register(_SOURCE, "XlaserveSwiglu", _TARGET)


def swiglu(gate_up: jax.Array, out_dtype=jnp.float32) -> jax.Array:
    if gate_up.ndim != 3 or gate_up.shape[1] != 2 or jnp.dtype(out_dtype) not in (jnp.float32,
                                                                                 jnp.bfloat16):
        raise ValueError(f"SwiGLU takes gate_up [T, 2, I] and a float32 or bfloat16 output; got "
                         f"{gate_up.shape}, {out_dtype}")
    load()
    rows, _, width = gate_up.shape
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((rows, width), out_dtype))
    return call(gate_up.astype(jnp.float32))
