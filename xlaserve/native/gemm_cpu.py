"""Matmuls on the CPU over weights pre-packed in panels: `gemm_cpu.cc` as an XLA FFI custom call.

    pairs = uses_bf16_pairs(w.dtype, k)     # the layout a weight gets (see below)
    packed = pack_columns(w, pairs)         # w [K, N] -> [ceil(N/P), K, P]
    packed = pack_rows(e, pairs)            # e [N, K], used as x @ e.T (a tied LM head) -> the same
    y = packed_matmul(x, packed, n, bf16_pairs=pairs)  # x [M, K] -> float32 [M, N]
    y = packed_matmul(x, jnp.stack([packed, ...]), n, layer=i, bf16_pairs=pairs)  # no copy
    a = packed_matmul_swiglu(x, packed, 2 * i, ...)  # silu(x @ W[:, :i]) * (x @ W[:, i:])
    rows = packed_rows(packed, ids, pairs)  # e[ids] from pack_rows(e): the embedding lookup
    groups = pack_groups(ws, pairs)         # ws [G, K, N] -> [G, ceil(N/P), K, P]: the experts
    y = packed_grouped_matmul(x, groups, group_sizes, n, bf16_pairs=pairs)  # rows sorted by group

P, the panel width, is the kernel's (`panel_width()`: 16, or 32 on CPUs with AVX-512). Packing is
done once, when the weights are placed (runtime/executor/model_runner.py); a panel is then one contiguous
stream, which is what lets steps of a few rows run near memory speed. The experts' grouped matmul
(`grouped_gemm_cpu.cc`) runs the same panel kernels over each group's expert.

bfloat16 weights with an even K, on a CPU with AVX512_BF16, are packed in k-pairs (`bf16_pairs`:
each panel [K/2, P, 2], stored as the same [K, P] shape): the kernel then multiplies them by x
rounded to bfloat16 with VDPBF16PS, twice the products per instruction of float32 FMAs, as XLA's
bfloat16 dot (x cast to bfloat16, float32 sums) would. Elsewhere bfloat16 weights are widened in
registers and multiply float32 x.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.native.build import register

TARGET_NAME = "xlaserve_packed_gemm_cpu"
SWIGLU_TARGET_NAME = "xlaserve_packed_gemm_swiglu_cpu"
GROUPED_TARGET_NAME = "xlaserve_grouped_packed_gemm_cpu"
_SOURCE = Path(__file__).with_name("gemm_cpu.cc")
_GROUPED_SOURCE = Path(__file__).with_name("grouped_gemm_cpu.cc")


@functools.cache
def panel_width() -> int:
    """Builds and registers the custom call (once; raises KernelUnavailable) and returns the
    panel width it was compiled for."""
    library = register(_SOURCE, "XlaservePackedGemm", TARGET_NAME)
    library.XlaservePackedGemmPanel.restype = ctypes.c_int64
    return int(library.XlaservePackedGemmPanel())


def load() -> None:
    """Builds and registers every custom call of this module (raises KernelUnavailable)."""
    panel_width()
    register(_SOURCE, "XlaservePackedGemmSwiglu", SWIGLU_TARGET_NAME)
    register(_GROUPED_SOURCE, "XlaserveGroupedPackedGemm", GROUPED_TARGET_NAME)


@functools.cache
def bf16_pairs_supported() -> bool:
    """Whether the kernel was built with AVX512_BF16 (VDPBF16PS) for k-pair panels."""
    library = register(_SOURCE, "XlaservePackedGemm", TARGET_NAME)
    library.XlaservePackedGemmBf16Pairs.restype = ctypes.c_int64
    return bool(library.XlaservePackedGemmBf16Pairs())


def _pairs_fit(dtype, k: int) -> bool:
    """k-pair panels hold bfloat16 weights with an even K."""
    return jnp.dtype(dtype) == jnp.bfloat16 and k % 2 == 0


def uses_bf16_pairs(dtype, k: int) -> bool:
    """The layout `pack_columns` / `pack_rows` give a weight of this dtype and depth by default."""
    return _pairs_fit(dtype, k) and bf16_pairs_supported()


def _to_pairs(packed: jax.Array) -> jax.Array:
    """[panels, K, P] -> the k-pair layout: [panels, K/2, P, 2], seen as [panels, K, P]."""
    panels, k, panel = packed.shape
    return packed.reshape(panels, k // 2, 2, panel).transpose(0, 1, 3, 2).reshape(panels, k, panel)


def _from_pairs(packed: jax.Array) -> jax.Array:
    panels, k, panel = packed.shape
    return packed.reshape(panels, k // 2, panel, 2).transpose(0, 1, 3, 2).reshape(panels, k, panel)


def _panels(n: int, panel: int) -> int:
    return -(-n // panel)


def pack_rows(e: jax.Array, bf16_pairs: bool | None = None) -> jax.Array:
    """[N, K] -> [ceil(N/P), K, P]: panel p, row k, lane j holds e[P*p + j, k] (zero padding), or
    in k-pairs (`bf16_pairs`; by default `uses_bf16_pairs`)."""
    panel, (n, k) = panel_width(), e.shape
    e = jnp.pad(e, ((0, _panels(n, panel) * panel - n), (0, 0)))
    packed = e.reshape(_panels(n, panel), panel, k).transpose(0, 2, 1)
    return _to_pairs(packed) if _pairs(bf16_pairs, e.dtype, k) else packed


def pack_columns(w: jax.Array, bf16_pairs: bool | None = None) -> jax.Array:
    """[K, N] -> [ceil(N/P), K, P]: panel p, row k, lane j holds w[k, P*p + j] (zero padding), or
    in k-pairs (`bf16_pairs`; by default `uses_bf16_pairs`)."""
    panel, (k, n) = panel_width(), w.shape
    w = jnp.pad(w, ((0, 0), (0, _panels(n, panel) * panel - n)))
    packed = w.reshape(k, _panels(n, panel), panel).transpose(1, 0, 2)
    return _to_pairs(packed) if _pairs(bf16_pairs, w.dtype, k) else packed


def _pairs(bf16_pairs: bool | None, dtype, k: int) -> bool:
    if bf16_pairs is None:
        return uses_bf16_pairs(dtype, k)
    if bf16_pairs and not _pairs_fit(dtype, k):
        raise ValueError(f"k-pair panels take bfloat16 weights with an even K; got {dtype}, K={k}")
    return bf16_pairs


def unpack_columns(packed: jax.Array, n: int, bf16_pairs: bool = False) -> jax.Array:
    """The inverse of `pack_columns`: [K, N]."""
    packed = _from_pairs(packed) if bf16_pairs else packed
    panels, k, panel = packed.shape
    return packed.transpose(1, 0, 2).reshape(k, panels * panel)[:, :n]


def packed_rows(packed: jax.Array, ids: jax.Array, bf16_pairs: bool = False) -> jax.Array:
    """e[ids] [T, K] for packed = pack_rows(e, bf16_pairs)."""
    panels, k, panel = packed.shape
    if bf16_pairs:
        pairs = packed.reshape(panels, k // 2, panel, 2)[ids // panel, :, ids % panel]
        return pairs.reshape(ids.shape[0], k)
    return packed[ids // panel, :, ids % panel]


def packed_matmul_swiglu(x: jax.Array, packed: jax.Array, n: int, layer: int = 0,
                         bf16_pairs: bool = False, out_dtype=jnp.float32,
                         invariant: bool = False) -> jax.Array:
    """silu(g) * u for [g | u] = x @ W, W [K, N = 2I] packed as for `packed_matmul` (the gate's
    columns, then the up projection's): [M, I] in `out_dtype` (float32 or bfloat16). Where I is a
    multiple of the panel width the kernel computes it without writing the [M, 2I] product;
    otherwise it is `packed_matmul` and XLA's activation."""
    width = n // 2
    if n % 2 or width % panel_width():
        y = packed_matmul(x, packed, n, layer, bf16_pairs, invariant)
        return (jax.nn.silu(y[:, :width]) * y[:, width:]).astype(out_dtype)
    _check(x, packed, n, layer, bf16_pairs)
    load()
    call = jax.ffi.ffi_call(SWIGLU_TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], width), out_dtype))
    x = x.astype(jnp.bfloat16 if bf16_pairs else jnp.float32)
    return call(x, packed, layer=np.int64(layer), bf16_pairs=bool(bf16_pairs),
                invariant=bool(invariant))


def _check(x: jax.Array, packed: jax.Array, n: int, layer: int, bf16_pairs: bool,
           grouped: bool = False) -> None:
    panel = panel_width()
    matrix = packed.shape[-3:]
    axes = 4 if grouped else 3  # without the layers' axis
    shape = f"[(L,){' G,' if grouped else ''} ceil(N/{panel}), K, {panel}]"
    if x.ndim != 2 or packed.ndim not in (axes, axes + 1) or matrix != (
            _panels(n, panel), x.shape[1], panel) or (
            packed.dtype not in (jnp.float32, jnp.bfloat16)) or not (
            0 <= layer < (packed.shape[0] if packed.ndim == axes + 1 else 1)):
        raise ValueError(f"packed_matmul takes x [M, K] and float32/bfloat16 panels {shape} (and "
                         f"a layer < L); got {x.shape}, {packed.shape} {packed.dtype} for N={n}, "
                         f"layer {layer}")
    if bf16_pairs and not uses_bf16_pairs(packed.dtype, x.shape[1]):
        raise ValueError("k-pair panels need bfloat16 weights, an even K and a CPU with AVX512_BF16")


def packed_matmul(x: jax.Array, packed: jax.Array, n: int, layer: int = 0,
                  bf16_pairs: bool = False, invariant: bool = False) -> jax.Array:
    """x [M, K] @ W [K, N] -> float32 [M, N], W given as `pack_columns(W)` (or `pack_rows(W.T)`),
    float32 or bfloat16, or as a stack of such [L, ...] of which `layer` is used (passing the
    stack costs no copy, where slicing it in XLA would). `bf16_pairs` says the panels are in
    k-pairs (and x is then rounded to bfloat16). `invariant`: each row's sums in one order
    whatever M (--enable-deterministic-inference; gemm_tiles.h, Invariant)."""
    _check(x, packed, n, layer, bf16_pairs)
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    # With pairs, x is rounded here, where XLA fuses the rounding into the op that produces x:
    # a separate pass over x in the kernel cost ~5% of a 128-row decode step.
    x = x.astype(jnp.bfloat16 if bf16_pairs else jnp.float32)
    return call(x, packed, layer=np.int64(layer), bf16_pairs=bool(bf16_pairs),
                invariant=bool(invariant))


def pack_groups(weights: jax.Array, bf16_pairs: bool | None = None) -> jax.Array:
    """[G, K, N] -> [G, ceil(N/P), K, P]: each group's matrix as `pack_columns` packs it."""
    pairs = _pairs(bf16_pairs, weights.dtype, weights.shape[1])
    return jax.vmap(functools.partial(pack_columns, bf16_pairs=pairs))(weights)


def packed_grouped_matmul(x: jax.Array, packed: jax.Array, group_sizes: jax.Array, n: int,
                          layer: int = 0, bf16_pairs: bool = False,
                          invariant: bool = False) -> jax.Array:
    """model/grouped_matmul.py's contract over packed matrices: x [M, K], its rows sorted by
    group, group g (`group_sizes[g]` rows) times W_g [K, N] -> float32 [M, N], zero past
    sum(group_sizes). `packed` is `pack_groups(W)` [G, ...], or a stack of such [L, G, ...] of
    which `layer` is used (no copy). A group with no rows costs nothing: its panels are not read.
    sum(group_sizes) > M is refused (the custom call fails)."""
    _check(x, packed, n, layer, bf16_pairs, grouped=True)
    if group_sizes.shape != (packed.shape[-4],):
        raise ValueError(f"packed_grouped_matmul takes one group size per matrix: "
                         f"{group_sizes.shape} for {packed.shape[-4]} matrices")
    load()
    call = jax.ffi.ffi_call(GROUPED_TARGET_NAME,
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    x = x.astype(jnp.bfloat16 if bf16_pairs else jnp.float32)  # as in packed_matmul
    return call(x, group_sizes.astype(jnp.int32), packed, layer=np.int64(layer),
                bf16_pairs=bool(bf16_pairs), invariant=bool(invariant))
