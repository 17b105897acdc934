"""The experts' grouped matmul as a Pallas GPU kernel (Triton lowering): only routed rows are
multiplied, each by its own expert's matrix (sm80 and later; the contract of
model/grouped_matmul.py: x [M, K] sorted by group, weights [G, K, N], group_sizes i32[G] ->
float32 [M, N], rows past the groups' total zero).

Why: XLA lowers `ragged_dot` on GPU to one dense dot of every row by every expert under a mask,
G / top_k times the routed FLOPs (64x for DeepSeek-V2-Lite, 128x for Qwen3-30B-A3B); the H100
took 2.96 ms for V2-Lite's expert matmul where reading its weights once takes ~0.22 ms
(docs/tpu-gpu.md).

The grid is (column tiles, visits). A visit is `block_m` consecutive rows of one group: group g
of s rows takes ceil(s / block_m) visits, its last one part empty (masked at the store), and the
rows past the groups' total are visits of a last "group" that write zeros and read nothing. The
visits are laid out by a few XLA ops over G + visits int32s (`visits`); their number is data, so
the grid has the most there can be, `max_visits` (rows / block_m + G + 1), and programs past the
last real visit return at once. A visit never spans two groups, so no row is written twice and no
store needs an atomic; a group's visits are neighbours in the grid, so its weight tiles are read
from DRAM about once and from L2 after.

Its cost, which XLA's analysis cannot see in a custom call (benchmarks/predict_accelerators.py
adds `expected_cost`): a group's visits are whole blocks of rows, so over the routed 2 * M * K * N
it computes 1 + (G + 1) * (block_m - 1) / M times at most, and with a uniform routing 1.43 times
at a 256-row decode of Qwen3-30B-A3B (2048 routed rows over 128 experts, 16-row visits; 1.94 at
most), 1.12 at 4096 prompt tokens (64-row visits; 1.25 at most). The dense form is G times.

Tile sizes follow vLLM's fused-MoE defaults (64-row tiles for long steps, 16 for decode, 4 warps),
not tuned on hardware. `interpret=True` runs the kernel on the CPU (tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.pallas_kernels.gpu_tiles import H100_SMS, column_tile

# The kernel's name in the compiled program, with its rows per visit: "grouped_matmul_gpu_m16"
# (benchmarks/predict_accelerators.py counts its FLOPs and bytes from it).
NAME = "grouped_matmul_gpu"
SWIGLU_NAME = "grouped_swiglu_gpu"  # the gate_up product with the SwiGLU fused
MIN_BLOCK = 16  # Triton's dot wants power-of-two tiles of at least 16 along every dimension
MAX_BLOCK_M = 64
BLOCK_K_CHOICES = (64, 32, 16)


def supports(k: int, n: int) -> str | None:
    """Why the kernel cannot multiply [K, N] experts; None if it can."""
    if k % MIN_BLOCK or n % MIN_BLOCK:
        return f"experts of {k} x {n} (the GPU grouped matmul needs multiples of {MIN_BLOCK})"
    return None


def block_rows(rows: int, groups: int) -> int:
    """Rows per visit: the largest power of two up to the mean group size (rows / groups),
    between 16 (the smallest dot) and MAX_BLOCK_M. Each group wastes at most block_m - 1 rows of
    its last visit; a long step's groups are large enough for 64-row tiles to waste little."""
    block_m = MIN_BLOCK
    while 2 * block_m * groups <= rows and block_m < MAX_BLOCK_M:
        block_m *= 2
    return block_m


def max_visits(rows: int, groups: int, block_m: int) -> int:
    """The most visits `rows` rows in `groups` groups and the tail can take: sum over the G + 1
    parts of ceil(s / block_m) <= (rows + (G + 1)(block_m - 1)) / block_m, and never more than
    one visit a row."""
    return max(1, min(rows, (rows + (groups + 1) * (block_m - 1)) // block_m))


def expected_cost(block_m: int, rows: int, groups: int, k: int, n: int, itemsize: int,
                  out_itemsize: int = 4, out_columns: int | None = None) -> tuple[float, float]:
    """(FLOPs, bytes) of one call, expected where the `rows` (token, expert) pairs are routed
    uniformly: each group's size ~ Binomial(rows, 1 / groups), a group of s rows taking
    ceil(s / block_m) whole visits of FLOPs and its expert's weights read once if s > 0 (a group's
    visits are neighbours: L2 serves the rest); x read and the output (`out_columns`, default
    N, of `out_itemsize` bytes; the fused SwiGLU's is half its weights' N) written once. At
    most `max_visits` visits of FLOPs whatever the routing (a 256-row decode of Qwen3-30B-A3B: 1.43
    times the routed rows' FLOPs expected, 1.94 at most)."""
    sizes = np.arange(rows + 1)
    p = 1.0 / groups
    log_choose = np.concatenate([[0.0], np.cumsum(np.log(rows - sizes[1:] + 1) - np.log(sizes[1:]))])
    log_pmf = log_choose + sizes * np.log(p) + (rows - sizes) * np.log1p(-p)
    pmf = np.exp(log_pmf)
    visits = groups * float(np.sum(pmf * np.ceil(sizes / block_m)))
    experts_read = groups * (1.0 - float(pmf[0]))
    return (2.0 * k * n * block_m * visits,
            experts_read * k * n * itemsize
            + rows * (k * itemsize + (out_columns or n) * out_itemsize))


def visits(group_sizes: jax.Array, rows: int, block_m: int, num_visits: int):
    """(group, first row, end row) of each visit, i32[num_visits] each: groups 0..G-1 the
    experts, G the rows past their total (zeros), G + 1 no visit (past the last)."""
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    part_ends = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)])
    part_sizes = jnp.concatenate([sizes, (rows - ends[-1:]).astype(jnp.int32)])
    part_starts = part_ends - part_sizes
    part_visits = (part_sizes + block_m - 1) // block_m
    visit_ends = jnp.cumsum(part_visits)
    visit = jnp.arange(num_visits, dtype=jnp.int32)
    # searchsorted by comparing all ([visits, G + 1] int32s): its default scan is a while loop,
    # whose predicate a GPU reads on the host between kernels.
    group = jnp.sum(visit_ends[None, :] <= visit[:, None], axis=1, dtype=jnp.int32)
    part = jnp.minimum(group, groups)
    start = part_starts[part] + (visit - (visit_ends[part] - part_visits[part])) * block_m
    end = jnp.minimum(start + block_m, part_ends[part])
    return group, start, end


def grouped_matmul_gpu(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                       out_dtype=jnp.float32, **options) -> jax.Array:
    """out_dtype [M, N], float32 by default (model/grouped_matmul.py's contract; the module
    docstring); accumulated in float32 either way. `options`: `_grouped`'s tiles and interpret."""
    return _grouped(x, weights, group_sizes, out_dtype, swiglu=False, **options)


def grouped_swiglu_gpu(x: jax.Array, gate_up: jax.Array, group_sizes: jax.Array,
                       out_dtype=jnp.float32, **options) -> jax.Array:
    """silu(x @ gate) * (x @ up) of each row's expert, gate_up [G, K, 2, I]: out_dtype [M, I],
    rows past the groups' total zero. Each program multiplies its rows by both halves' column
    tiles and writes the activation, where the two-step form wrote the [M, 2I] gate_up product
    and read it back (Qwen3-30B-A3B at 4096 prompt tokens: 201 MB a layer each way in bfloat16,
    against its experts' 805 MB). Accumulated and activated in float32, rounded once."""
    return _grouped(x, gate_up, group_sizes, out_dtype, swiglu=True, **options)


def _grouped(x, weights, group_sizes, out_dtype, *, swiglu: bool, block_m: int | None = None,
             block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
             num_stages: int = 3, num_k_splits: int = 1, interpret: bool = False) -> jax.Array:
    """`num_k_splits` > 1: each (column tile, visit) is that many programs over parts of K,
    whose float32 partial products (gate's and up's with `swiglu`) XLA sums, and activates,
    after the call. A candidate for steps of few rows, where 8 visits of a batch-1 step took
    ~0.11 ms on an H200 whatever the tile, 12x their bytes' time: each program a serial loop of
    K / block_k steps (timed by benchmarks/check_gpu_ragged_dot.py; not the default)."""
    rows, k = x.shape
    groups, n = weights.shape[0], weights.shape[-1]  # n: the output's columns
    problem = supports(k, n)
    if problem is not None:
        raise ValueError(problem)
    block_k = block_k or next(b for b in BLOCK_K_CHOICES if k % b == 0)
    if (k // block_k) % num_k_splits:
        raise ValueError(f"{k // block_k} K steps of {block_k} do not split {num_k_splits} ways")
    plan = plan_visits(x.astype(weights.dtype), group_sizes, groups, n, block_m, block_n,
                       num_k_splits)
    if swiglu:  # gate's and up's column tiles of the same columns
        weight_spec = pl.BlockSpec((groups, k, 2, plan.block_n), lambda c, v, *_: (0, 0, 0, c))
    else:
        weight_spec = pl.BlockSpec((groups, k, plan.block_n), lambda c, v, *_: (0, 0, c))
    products = 2 if swiglu else 1
    if num_k_splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows + plan.block_m, n), out_dtype)
        out_spec = plan.out_spec
    else:  # per product (gate, up): [splits, rows, N] float32 partial sums
        out_shape = [jax.ShapeDtypeStruct((num_k_splits, rows + plan.block_m, n),
                                          jnp.float32)] * products
        out_spec = [pl.BlockSpec((None, rows + plan.block_m, plan.block_n),
                                 lambda c, v, split: (split, 0, c))] * products
    out = pl.pallas_call(
        functools.partial(_kernel, groups=groups, block_m=plan.block_m, block_k=block_k,
                          swiglu=swiglu, k_steps=k // block_k // num_k_splits,
                          partial_sums=num_k_splits > 1),
        out_shape=out_shape,
        grid=plan.grid,  # axis 0 runs fastest: a visit's column tiles together
        in_specs=plan.in_specs + [weight_spec],
        out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"{SWIGLU_NAME if swiglu else NAME}_m{plan.block_m}",
    )(*plan.visit_arrays, plan.x, weights)
    if num_k_splits == 1:
        return out[:rows]
    summed = [jnp.sum(part[:, :rows], axis=0) for part in out]
    return (swiglu_of(*summed) if swiglu else summed[0]).astype(out_dtype)


def swiglu_of(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in gate's dtype (float32 here), as the kernel computes it."""
    return gate / (1.0 + jnp.exp(-gate)) * up


@dataclasses.dataclass(frozen=True)
class VisitPlan:
    """What a grouped matmul's pallas_call shares with the others (the MXFP4 one too): the grid
    (column tiles, visits), the visits' (group, first row, end row) and x padded by a visit."""
    block_m: int
    block_n: int
    grid: tuple[int, int]
    visit_arrays: tuple[jax.Array, jax.Array, jax.Array]
    x: jax.Array  # [rows + block_m, K]
    in_specs: list  # of the visit arrays and x
    out_spec: pl.BlockSpec


def plan_visits(x: jax.Array, group_sizes: jax.Array, groups: int, n: int,
                block_m: int | None = None, block_n: int | None = None,
                num_k_splits: int = 1) -> VisitPlan:
    """The grid is (column tiles, visits), and (..., K splits) where `num_k_splits` > 1."""
    rows, k = x.shape
    block_m = block_m or block_rows(rows, groups)
    num_visits = max_visits(rows, groups, block_m)
    # Every SM two programs at least (batch 1 of Qwen3-30B-A3B: 8 visits, gate_up's 1536
    # columns in 32-wide tiles, 384 programs).
    block_n = block_n or column_tile(n, num_visits, 2 * H100_SMS)
    # A visit's rows are read as a whole block: the padding keeps the last one in bounds (a
    # masked load past the end would be right on the GPU, but the interpreter clamps the slice).
    padded = jnp.pad(x, ((0, block_m), (0, 0)))
    grid = (n // block_n, num_visits) + ((num_k_splits,) if num_k_splits > 1 else ())
    return VisitPlan(
        block_m, block_n, grid,
        visits(group_sizes, rows, block_m, num_visits), padded,
        [pl.BlockSpec((num_visits,), lambda c, v, *_: (0,))] * 3
        + [pl.BlockSpec(padded.shape, lambda c, v, *_: (0, 0))],
        pl.BlockSpec((rows + block_m, block_n), lambda c, v, *_: (0, c)))


def visit_rows(group_ref, start_ref, end_ref, out_ref, block_m: int):
    """Inside a kernel: (group, first row, the [block_m, block_n] mask of the visit's rows, the
    output block they go to) of this program's visit."""
    visit = pl.program_id(1)
    group, start, end = group_ref[visit], start_ref[visit], end_ref[visit]
    rows_here = (start + jnp.arange(block_m) < end)[:, None]
    rows_here = jnp.broadcast_to(rows_here, (block_m, out_ref.shape[1]))
    return group, start, rows_here, out_ref.at[pl.ds(start, block_m), :]


def zero_rows_past_the_groups(group, groups: int, target, rows_here) -> None:
    """The visits of the rows past the groups' total (group G) write zeros."""
    @pl.when(group == groups)
    def _zeros():
        plgpu.store(target, jnp.zeros(rows_here.shape, target.dtype), mask=rows_here)


def _kernel(group_ref, start_ref, end_ref, x_ref, w_ref, *out_refs, groups, block_m, block_k,
            swiglu, k_steps, partial_sums):
    """One visit's rows times one column tile; with `partial_sums`, over K steps [s * k_steps,
    (s + 1) * k_steps) of split s, each product's float32 sum written to its own out_ref
    [rows, block_n] unactivated."""
    out_ref = out_refs[0]
    group, start, rows_here, target = visit_rows(group_ref, start_ref, end_ref, out_ref, block_m)
    block_n = out_ref.shape[-1]
    first_step = pl.program_id(2) * k_steps if partial_sums else 0
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None  # no TF32 for f32

    @pl.when(group < groups)
    def _multiply():
        def step(kb, accs):
            x = x_ref[pl.ds(start, block_m), pl.ds(kb * block_k, block_k)]
            ks = pl.ds(kb * block_k, block_k)
            ws = ([w_ref[group, ks, 0, :], w_ref[group, ks, 1, :]] if swiglu
                  else [w_ref[group, ks, :]])
            return tuple(acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                               precision=precision,
                                               preferred_element_type=jnp.float32)
                         for acc, w in zip(accs, ws, strict=True))

        zeros = jnp.zeros((block_m, block_n), jnp.float32)
        accs = lax.fori_loop(first_step, first_step + k_steps, step,
                             (zeros,) * (2 if swiglu else 1))
        if partial_sums:
            for acc, ref in zip(accs, out_refs, strict=True):
                plgpu.store(ref.at[pl.ds(start, block_m), :], acc, mask=rows_here)
            return
        if swiglu:  # silu(gate) * up, as the activation's float32 (swiglu_xla)
            out = swiglu_of(*accs)
        else:
            (out,) = accs
        plgpu.store(target, out.astype(out_ref.dtype), mask=rows_here)

    for ref in out_refs:
        zero_rows_past_the_groups(group, groups, ref.at[pl.ds(start, block_m), :], rows_here)
