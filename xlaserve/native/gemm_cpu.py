"""Matmuls on the CPU over weights pre-packed in panels: `gemm_cpu.cc` as an XLA FFI custom call.

    packed = pack_columns(w)          # w [K, N] -> [ceil(N/P), K, P]
    packed = pack_rows(e)             # e [N, K], used as x @ e.T (a tied LM head) -> the same
    y = packed_matmul(x, packed, n)   # x [M, K] -> float32 [M, N]
    y = packed_matmul(x, jnp.stack([packed, ...]), n, layer=i)  # one of a stack, no copy
    rows = packed_rows(packed, ids)   # e[ids] from pack_rows(e): the embedding lookup

P, the panel width, is the kernel's (`panel_width()`: 16, or 32 on CPUs with AVX-512). Packing is
done once, when the weights are placed (runtime/model_runner.py); a panel is then one contiguous
stream, which is what lets steps of a few rows run near memory speed.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.native import register

TARGET_NAME = "xlaserve_packed_gemm_cpu"
_SOURCE = Path(__file__).with_name("gemm_cpu.cc")


@functools.cache
def panel_width() -> int:
    """Builds and registers the custom call (once; raises KernelUnavailable) and returns the
    panel width it was compiled for."""
    library = register(_SOURCE, "XlaservePackedGemm", TARGET_NAME)
    library.XlaservePackedGemmPanel.restype = ctypes.c_int64
    return int(library.XlaservePackedGemmPanel())


def load() -> None:
    panel_width()


def _panels(n: int, panel: int) -> int:
    return -(-n // panel)


def pack_rows(e: jax.Array) -> jax.Array:
    """[N, K] -> [ceil(N/P), K, P]: panel p, row k, lane j holds e[P*p + j, k] (zero padding)."""
    panel, (n, k) = panel_width(), e.shape
    e = jnp.pad(e, ((0, _panels(n, panel) * panel - n), (0, 0)))
    return e.reshape(_panels(n, panel), panel, k).transpose(0, 2, 1)


def pack_columns(w: jax.Array) -> jax.Array:
    """[K, N] -> [ceil(N/P), K, P]: panel p, row k, lane j holds w[k, P*p + j] (zero padding)."""
    panel, (k, n) = panel_width(), w.shape
    w = jnp.pad(w, ((0, 0), (0, _panels(n, panel) * panel - n)))
    return w.reshape(k, _panels(n, panel), panel).transpose(1, 0, 2)


def unpack_columns(packed: jax.Array, n: int) -> jax.Array:
    """The inverse of `pack_columns`: [K, N]."""
    panels, k, panel = packed.shape
    return packed.transpose(1, 0, 2).reshape(k, panels * panel)[:, :n]


def packed_rows(packed: jax.Array, ids: jax.Array) -> jax.Array:
    """e[ids] [T, K] for packed = pack_rows(e)."""
    panel = packed.shape[2]
    return packed[ids // panel, :, ids % panel]


def packed_matmul(x: jax.Array, packed: jax.Array, n: int, layer: int = 0) -> jax.Array:
    """x [M, K] @ W [K, N] -> float32 [M, N], W given as `pack_columns(W)` (or `pack_rows(W.T)`),
    float32 or bfloat16, or as a stack of such [L, ...] of which `layer` is used (passing the
    stack costs no copy, where slicing it in XLA would)."""
    panel = panel_width()
    matrix = packed.shape[-3:]
    if x.ndim != 2 or packed.ndim not in (3, 4) or matrix != (_panels(n, panel), x.shape[1], panel) or (
            packed.dtype not in (jnp.float32, jnp.bfloat16)) or not (
            0 <= layer < (packed.shape[0] if packed.ndim == 4 else 1)):
        raise ValueError(f"packed_matmul takes x [M, K] and float32/bfloat16 panels "
                         f"[(L,) ceil(N/{panel}), K, {panel}] (and a layer < L); got {x.shape}, "
                         f"{packed.shape} {packed.dtype} for N={n}, layer {layer}")
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), packed, layer=np.int64(layer))
