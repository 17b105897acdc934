"""Matmuls of a few rows on the CPU (decode steps): `matmul_cpu.cc` as an XLA FFI custom call.

    y = few_row_matmul(x, w)                   # x [M, K] @ w [K, N] -> float32 [M, N]
    y = few_row_matmul(x, e, transposed=True)  # x [M, K] @ e[N, K].T (a tied LM head)

M is at most MAX_ROWS; w is float32 or bfloat16; sums are float32.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.native import register

MAX_ROWS = 16
TARGET_NAME = "xlaserve_few_row_matmul_cpu"
_SOURCE = Path(__file__).with_name("matmul_cpu.cc")


def load() -> None:
    """Builds and registers the custom call (once); raises KernelUnavailable."""
    register(_SOURCE, "XlaserveFewRowMatmul", TARGET_NAME)


def few_row_matmul(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    load()
    rows = x.shape[0]
    if x.ndim != 2 or w.ndim != 2 or rows > MAX_ROWS or w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"few_row_matmul takes x [M<={MAX_ROWS}, K] and 2-d float32/bfloat16 "
                         f"weights; got {x.shape} and {w.shape} {w.dtype}")
    columns = w.shape[0] if transposed else w.shape[1]
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((rows, columns), jnp.float32))
    return call(x.astype(jnp.float32), w, transposed=np.bool_(transposed))
