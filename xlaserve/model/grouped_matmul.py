"""Grouped matmul: the rows of x, sorted by group, each multiplied by its group's matrix.

`grouped_matmul(x [M, K], weights [G, K, N], group_sizes i32[G], out_dtype=float32) ->
out_dtype [M, N]` (accumulated in float32; the GPU asks for the model dtype): rows
`[sum(group_sizes[:g]), sum(group_sizes[:g + 1]))` are multiplied by `weights[g]`; rows past
`sum(group_sizes)` are to be zero: with expert parallelism, pairs routed to other devices' experts
sit there (model/moe.py). The experts of a mixture-of-experts layer run as two of them. Shapes
depend only on M, so one compiled program serves any routing.

Three implementations here (`Kernels.grouped_matmul`; runtime/executor/kernels.py picks), and on
GPU a Pallas kernel (pallas_kernels/grouped_matmul_gpu.py: XLA lowers ragged_dot there to a dense
dot over every expert):
- `grouped_matmul_ragged_dot`: `jax.lax.ragged_dot`, on TPU. On TPU, XLA lowers it to
  megablox's algorithm as two Mosaic kernels: one maps tiles of rows to groups, the other runs only
  the tiles that hold a group's rows, a whole K x N matrix per block, so each expert's weights are
  read once per run of its tiles (`ragged_dot_tiling` in the HLO: 8..256 rows x K x N). Rows past
  the groups' total are NOT zeroed there: the compiled kernel stores under a row mask and never
  visits tiles past the last group, so they keep what its output buffer held (a third party's v6e
  run, JAX 0.10.2 / libtpu 0.0.42.1, found stale partial products there). The CPU's zeroes them.
- `grouped_matmul_megablox`: JAX's Pallas megablox `gmm` with the same tiles, rows past the total
  zeroed. Compiled for v6e, not picked (benchmarks/bench_grouped_matmul_tpu.py; Qwen3-30B-A3B's
  gate_up 2048 x 1536 and down 768 x 2048 over 128 experts, M = 8..4096, and their tp4 and ep4
  shards): both declare the flops of one dense pass (2 M K N, not G times); ragged_dot builds its
  tile map in one small Mosaic kernel, megablox in 44-76 XLA ops (cumsum, a histogram's while
  loop, scatters, a sort, gathers), with 0.3-1 MiB of temporaries against 0.06, declared bytes
  equal at M = 8 and up to 1.8x at 4096, and 2-4x the compile time (0.9-5.7 s against 0.3-1.6 s).
  Timed on a v6e by a third party (M 32768, K 4096, N 1536), the two kernels ran within 0.15% of
  each other, and the metadata took 6.6 us in ragged_dot against 65 us of XLA ops in a megablox
  port.
- `grouped_matmul_tiled`, for the CPU, where XLA lowers `ragged_dot` to a dense dot of every row
  by every group's matrix under a mask: G times the work (measured: 8 groups, 256 x 512 x 1024,
  16.0 ms against 1.5 ms for one dense dot of the same rows, 2-core Intel Xeon). Here each group's
  rows go in tiles of `tile_rows` through a loop whose trip count is the number of non-empty tiles,
  so each tile reads its group's matrix once and an empty group costs nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Rows of x per tile of the megablox kernel, at most: XLA's own TPU lowering of ragged_dot picks
# the same (its `ragged_dot_tiling`: 8 rows at 8, 128 at 128, 256 at 1024 and 4096).
MEGABLOX_MAX_TILE_ROWS = 256


def grouped_matmul_ragged_dot(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                              out_dtype=jnp.float32) -> jax.Array:
    return lax.ragged_dot(x.astype(weights.dtype), weights, group_sizes,
                          preferred_element_type=out_dtype)


def megablox_tiling(rows: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) of the megablox kernel: a group's whole K x N matrix per block, fetched once
    for a run of the group's tiles (the kernel skips the copy while the block index stays the
    same), and each tile of x fetched once; rows in tiles of at most MEGABLOX_MAX_TILE_ROWS (all of
    them in one tile below that: a whole dimension needs no alignment)."""
    return min(rows, MEGABLOX_MAX_TILE_ROWS), k, n


def grouped_matmul_megablox(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                            out_dtype=jnp.float32, *, interpret: bool = False) -> jax.Array:
    """JAX's Pallas TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox.gmm`), with
    `megablox_tiling`. `interpret` runs it on any platform (tests), in TPU interpret mode, whose
    uninitialized memory is NaN."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    rows, k = x.shape
    tm, tk, tn = megablox_tiling(rows, k, weights.shape[2])
    padded_rows = -(-rows // tm) * tm  # gmm takes whole tiles; padding rows are in no group
    x = jnp.pad(x.astype(weights.dtype), ((0, padded_rows - rows), (0, 0)))
    group_sizes = group_sizes.astype(jnp.int32)
    out = gmm(x, weights, group_sizes, preferred_element_type=out_dtype, tiling=(tm, tk, tn),
              interpret=pltpu.InterpretParams() if interpret else False)[:rows]
    # gmm never writes rows past the groups' total (tiles no group reaches, and the rest of the
    # last group's tile): they hold whatever the buffer held.
    return zero_rows_past_groups(out, group_sizes)


def zero_rows_past_groups(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    live = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], out, 0.0)


def tile_rows(rows: int, groups: int, largest: int = 64) -> int:
    """Rows per tile: a power of two near the mean group size (rows / groups), at most `largest`.
    At most rows / tile + groups tiles run, so each group's matrix is read about once or twice;
    a decode step (a few rows over many groups) takes one row per tile."""
    tile = 1
    while tile * groups < rows and tile < largest:
        tile *= 2
    return tile


def grouped_matmul_tiled(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                         out_dtype=jnp.float32) -> jax.Array:
    rows, k = x.shape
    _, _, n = weights.shape
    tile = tile_rows(rows, weights.shape[0])
    x = x.astype(weights.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    tiles_per_group = (group_sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_per_group)  # tiles of groups 0..g
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    # A tile that runs past its group's end writes rows of the next groups: their own tiles come
    # later and overwrite them. The padding keeps a last tile's slice from being shifted back.
    padded_x = jnp.concatenate([x, jnp.zeros((tile, k), x.dtype)])

    def one_tile(t, out):
        group = jnp.searchsorted(tile_ends, t, side="right")
        first_tile = tile_ends[group] - tiles_per_group[group]
        start = group_starts[group] + (t - first_tile) * tile
        x_tile = lax.dynamic_slice_in_dim(padded_x, start, tile)
        weight = lax.dynamic_index_in_dim(weights, group, keepdims=False)
        y = lax.dot_general(x_tile, weight, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
        return lax.dynamic_update_slice_in_dim(out, y, start, axis=0)

    out = lax.fori_loop(0, tile_ends[-1], one_tile, jnp.zeros((rows + tile, n), jnp.float32))
    return zero_rows_past_groups(out[:rows], group_sizes).astype(out_dtype)
