"""y = x @ w in which a row's result does not depend on the other rows of x: the matmul of
--enable-deterministic-inference on TPU and GPU (runtime/executor/kernels.py).

Why not XLA's dot: XLA picks its GEMM's tiling, and on GPU its cuBLAS algorithm or split-K, from
the whole shape, M included, so a row's sums over K change order with the number of rows beside
it (measured on the CPU: from M = 2 at K >= 576; the GPU's split-K is the known case, Thinking
Machines' "Defeating Nondeterminism in LLM Inference" and SGLang's batch-invariant ops).

Here the tiles depend on the weight alone: rows go in blocks of a fixed `block_m` (x padded up
to whole blocks), each program computes one [block_m, block_n] tile of y, and K is walked in
blocks of `block_k` in one order, each block's product added to a float32 accumulator. One
block's product is one MXU (TPU) or tensor-core (GPU) matmul of fixed shape, whose per-element
order the hardware fixes; Mosaic promises shape-invariant numerics besides
(`CompilerParams.shape_invariant_numerics`). No split-K, no tile chosen from M: a row's bits are
those of its block, whatever the block's other rows hold.

    x       [M, K]          (the weight's dtype)
    weight  [K, N], or [N, K] with `transposed` (a tied embedding as the LM head)
    ->      float32 [M, N]

Cost: decode steps multiply a whole `block_m` block (TPU 128 rows, GPU 64) however few rows run;
a decode step is bound by reading the weights, which is unchanged. Tiles are not tuned on
hardware. `interpret` runs the kernel on the CPU (tests): `pltpu.InterpretParams()` for the TPU
form, True for the GPU's.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

NAME = "invariant_matmul"  # the kernel's name in a compiled program


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A platform's tile sizes: rows per block (fixed), and the K and N tiles tried in order, the
    first that divides the weight's dimension taken."""

    block_m: int
    block_k: tuple[int, ...]
    block_n: tuple[int, ...]
    # TPU: a K no tile divides is taken whole (a block equal to the array's dimension is always
    # legal), an N the last block overhangs (its columns past N are dropped: a vocabulary of
    # 32001 taken whole needed 32 MB of VMEM); GPU: Triton's blocks are powers of two, so
    # either is refused.
    uneven: bool


TILES = {"tpu": Tiles(128, (512, 256, 128), (512, 256, 128), uneven=True),
         "gpu": Tiles(64, (64, 32, 16), (128, 64, 32, 16), uneven=False)}


def tile_for(dimension: int, tiles: Tiles, choices: tuple[int, ...],
             overhang: bool = False) -> int | None:
    """The first of `choices` that divides `dimension`; where none does, with `tiles.uneven`,
    the whole dimension if it is smaller than the largest choice, else (`overhang`) the largest
    choice, else the whole dimension; None otherwise."""
    fitting = [t for t in choices if dimension % t == 0]
    if fitting:
        return fitting[0]
    if not tiles.uneven:
        return None
    return choices[0] if overhang and dimension > choices[0] else dimension


def supports(k: int, n: int, platform: str) -> str | None:
    """Why the kernel cannot multiply a [K, N] weight on `platform`; None if it can."""
    if platform not in TILES:
        return f"the batch-invariant matmul runs on TPU and GPU, not on {platform}"
    tiles = TILES[platform]
    for name, size, choices in (("K", k, tiles.block_k), ("N", n, tiles.block_n)):
        if tile_for(size, tiles, choices) is None:
            return (f"{name} = {size} (the {platform.upper()} batch-invariant matmul needs a "
                    f"multiple of {choices[-1]})")
    return None


def invariant_matmul(x: jax.Array, weight: jax.Array, *, platform: str,
                     transposed: bool = False, interpret=False) -> jax.Array:
    """float32 [M, N] = x @ weight (module docstring); `platform` "tpu" or "gpu"."""
    rows, k = x.shape
    n = weight.shape[0] if transposed else weight.shape[1]
    if weight.shape[1 if transposed else 0] != k:
        raise ValueError(f"invariant matmul of x {x.shape} by weight {weight.shape}"
                         f"{' (transposed)' if transposed else ''}: K disagrees")
    problem = supports(k, n, platform)
    if problem is not None:
        raise ValueError(problem)
    tiles = TILES[platform]
    block_m = tiles.block_m
    block_k = tile_for(k, tiles, tiles.block_k)
    block_n = tile_for(n, tiles, tiles.block_n, overhang=True)
    padded = -(-rows // block_m) * block_m
    x = jnp.pad(x.astype(weight.dtype), ((0, padded - rows), (0, 0)))
    call = _tpu_call if platform == "tpu" else _gpu_call
    out = call(x, weight, n, block_m, block_k, block_n, transposed, interpret)
    return out[:rows]


def _contract(x, w, transposed: bool):
    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
    return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def _tpu_call(x, weight, n, block_m, block_k, block_n, transposed, interpret):
    """Grid (row blocks, column blocks, K blocks), K innermost and in order ("arbitrary"): the
    output tile stays in VMEM across the K blocks and takes each block's product in turn."""
    k = x.shape[1]
    w_spec = (pl.BlockSpec((block_n, block_k), lambda i, j, kb: (j, kb)) if transposed
              else pl.BlockSpec((block_k, block_n), lambda i, j, kb: (kb, j)))

    def kernel(x_ref, w_ref, out_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

        out_ref[...] += _contract(x_ref[...], w_ref[...], transposed)

    return pl.pallas_call(
        kernel, name=NAME,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
        grid=(x.shape[0] // block_m, pl.cdiv(n, block_n), k // block_k),
        in_specs=[pl.BlockSpec((block_m, block_k), lambda i, j, kb: (i, kb)), w_spec],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kb: (i, j)),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(x, weight)


def _gpu_call(x, weight, n, block_m, block_k, block_n, transposed, interpret):
    """Grid (row blocks, column blocks); each program walks K in `block_k` slices in order (the
    fp8_block_matmul.py pattern: whole-K blocks sliced in the kernel)."""
    k = x.shape[1]
    k_blocks = k // block_k
    w_spec = (pl.BlockSpec((block_n, k), lambda i, j: (j, 0)) if transposed
              else pl.BlockSpec((k, block_n), lambda i, j: (0, j)))

    def kernel(x_ref, w_ref, out_ref):
        def step(kb, acc):
            span = pl.ds(kb * block_k, block_k)
            w = w_ref[:, span] if transposed else w_ref[span, :]
            return acc + _contract(x_ref[:, span], w, transposed)

        out_ref[...] = lax.fori_loop(0, k_blocks, step,
                                     jnp.zeros(out_ref.shape, jnp.float32))

    return pl.pallas_call(
        kernel, name=NAME,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
        grid=(x.shape[0] // block_m, n // block_n),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)), w_spec],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(x, weight)


def for_platform(platform: str, interpret: bool = False):
    """`invariant_matmul` bound to `platform` (interpreted on the CPU with `interpret`)."""
    mode = (pltpu.InterpretParams() if platform == "tpu" else True) if interpret else False
    return functools.partial(invariant_matmul, platform=platform, interpret=mode)
