"""The gated delta rule of Gated DeltaNet layers as a Pallas TPU (Mosaic) kernel (issue 76), with
reference.py's contract (float32):

    out, pool = gated_delta_rule(q, k, v, g, beta, pool, state_slots, kv_lens, cu_q_lens,
                                 num_seqs, writes=None, interpret=False)

The chunked form (reference.chunked_gated_delta_rule, transformers' and flash-linear-attention's
algorithm): a block of `ROW_BLOCK` rows of one sequence is one chunk, its rows' writes solved
together in matmuls on the MXU, each sequence's state [Hv, Dk, Dv] (2 MiB at Qwen3-Next's 32
heads of 128 x 128) in VMEM scratch across its chunks, DMA'd in from the pool at its first
(zeros where the step holds its prompt's first token) and back at its last (where it writes:
`writes`), the pool aliased in -> out and left in HBM. The recurrent form, a row at a time, did
per row and head three matrix-vector products on the MXU (1/128 of its rows used): a 512-row
chunk of a prompt was 512 x 32 x 3 sequential MXU passes a layer.

The grid runs work items in order ("arbitrary": the state passes from item to item): an item is
the rows of one sequence within one block, so q, k, v and the outputs move in blocks that Pallas
pipelines, and a block that two sequences share is visited by consecutive items (its output
block stays in VMEM, written back once). An item's chunk is the whole block with the other rows
masked (their decay 1, their write strength 0: they change nothing), so every chunk has the
block's static shape; an item of one row (a decode row) takes the recurrent form's three
matrix-vector products a head instead (a chunk's ~17 matmuls for one row). Per value head, with
c the cumulative log decay and D[i, j] = exp(c_i - c_j) (j <= i):

    A = tril(beta k k^T D, -1),  T = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...   (A nilpotent)
    u = T (beta v),  w = T (beta exp(c) k),  v' = u - w S
    o = exp(c) q S + tril(q k^T D) v',  S <- exp(c_last) S + (exp(c_last - c) k)^T v'

T as a product of log2(block) factors: matmuls, not a row-by-row substitution. q, k, v, g and
beta go in head-major ([heads, T, ...], transposed in XLA) so that a head's rows are one VMEM
tile; q and k stay per key head (normalized in XLA, not repeated to the value heads). Every
matmul at HIGHEST precision (float32). The heads are a static loop; not yet timed on a TPU.
Form "ssd" (Mamba-2's scan, reference.py) is the same without the delta: A = 0, u = beta v,
w = 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from xlaserve.pallas_kernels.linear_attention import reference

ROW_BLOCK = 32  # rows of q, k, v and out a grid step holds (Qwen3-Next: 512 KiB a block)
EXACT = lax.Precision.HIGHEST  # float32 on the MXU (the default rounds operands to bfloat16)
VMEM_BUDGET = 16 << 20  # v5e's default scoped VMEM (v6e's is 32 MiB)


def row_block(num_rows: int, most: int = ROW_BLOCK) -> int:
    """Rows of a block: the largest power of two up to `most` that divides the step's rows."""
    block = most
    while num_rows % block:
        block //= 2
    return block


def check_vmem(block: int, key_heads: int, heads: int, key_dim: int, value_dim: int) -> None:
    """ValueError where the state and the double-buffered row blocks exceed VMEM_BUDGET
    (Qwen3-Next at one device: 2 MiB of state, 5 MiB of blocks: g and beta columns take a
    128-lane tile each)."""
    state = heads * key_dim * value_dim * 4
    blocks = 2 * block * 4 * (2 * key_heads * key_dim + 2 * heads * value_dim + 2 * heads * 128)
    if state + blocks > VMEM_BUDGET:
        raise ValueError(f"the TPU gated delta rule's state ({heads} heads of {key_dim} x "
                         f"{value_dim}) and {block}-row blocks take {(state + blocks) >> 20} MiB "
                         f"of VMEM, over {VMEM_BUDGET >> 20} MiB: split the value heads (tp)")


def work_items(cu_q_lens, num_seqs, num_rows: int, block: int):
    """The step's rows cut at every block edge and sequence start: int32 arrays [N] (N = blocks +
    sequences + 1, a static count; items past the last are empty) of each item's sequence (-1:
    padding rows or empty), first and end row, row block, and whether it starts its block (its
    output block is zeroed then). Sorted, the cuts make consecutive items of a sequence
    consecutive in the grid."""
    live = jnp.arange(cu_q_lens.shape[0]) <= num_seqs[0]
    cuts = jnp.concatenate([jnp.arange(0, num_rows, block, dtype=jnp.int32),
                            jnp.where(live, jnp.minimum(cu_q_lens, num_rows), num_rows)])
    starts = jnp.sort(cuts)
    ends = jnp.concatenate([starts[1:], jnp.array([num_rows], jnp.int32)])
    seq = reference.row_sequences(cu_q_lens, num_seqs, num_rows)[jnp.minimum(starts, num_rows - 1)]
    seq = jnp.where(ends > starts, seq, -1)
    blocks = jnp.minimum(starts // block, num_rows // block - 1)
    opens = jnp.concatenate([jnp.array([True]), blocks[1:] != blocks[:-1]])
    return seq, starts, ends, blocks, opens.astype(jnp.int32)


def gated_delta_rule(q, k, v, g, beta, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                     writes=None, form: str = "delta", interpret=False, block_rows=ROW_BLOCK):
    """reference.gated_delta_rule on TPU: out [T, Hv, Dv] in v's dtype (padding rows zero), the
    pool (float32 [slots, Hv, Dk, Dv], updated in place) with each sequence's state after its last
    row, but where `writes` is 0 (reference.gated_delta_rule). `interpret`: False on a TPU, True
    to run it on the CPU (tests); `block_rows`: the most rows of a block (of a chunk). `form`
    "ssd": Mamba-2's scan (reference.py), no delta: u = beta v, w = 0."""
    q, k, v32, g, beta = reference.pallas_inputs(q, k, v, g, beta, state_pool, form, "TPU")
    state_slots, kv_lens, cu_q_lens, num_seqs = (jnp.asarray(x, jnp.int32) for x in (
        state_slots, kv_lens, cu_q_lens, num_seqs))
    rows, heads, value_dim = v32.shape
    key_heads, key_dim = k.shape[1:]
    block = row_block(rows, block_rows)
    check_vmem(block, key_heads, heads, key_dim, value_dim)
    seq, starts, ends, blocks, opens = work_items(cu_q_lens, num_seqs, rows, block)
    s = jnp.maximum(seq, 0)
    # The state is read at a sequence's first item (zeros for a fresh prompt), written at its last
    # (where the sequence writes its slot).
    first = (seq >= 0) & (starts == cu_q_lens[s])
    fresh = first & (kv_lens[s] == cu_q_lens[s + 1] - cu_q_lens[s])
    writing = reference.all_writes(writes, state_slots)[s] != 0
    last = (seq >= 0) & (ends == cu_q_lens[s + 1]) & writing
    loads = jnp.where(fresh, 2, first.astype(jnp.int32))  # 0: carried, 1: from the pool, 2: zeros
    slots = state_slots[s]

    # Head-major: a head's rows of a block are one [block, width] tile.
    rows_of = lambda head_count, width: pl.BlockSpec((head_count, block, width),
                                                     lambda i, b, *_: (0, b[i], 0))
    by_head = lambda x: jnp.swapaxes(x, 0, 1)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_chunk_kernel, heads=heads, values_per_key=heads // key_heads,
                               block=block, delta=form == "delta")
    out, pool = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((heads, rows, value_dim), jnp.float32),
                   jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7, grid=(seq.shape[0],),
            in_specs=[rows_of(key_heads, key_dim), rows_of(key_heads, key_dim),
                      rows_of(heads, value_dim), rows_of(heads, 1), rows_of(heads, 1), hbm],
            out_specs=[rows_of(heads, value_dim), hbm],
            scratch_shapes=[pltpu.VMEM((heads, key_dim, value_dim), jnp.float32),
                            pltpu.SemaphoreType.DMA(())]),
        input_output_aliases={12: 1},  # the pool: after the 7 scalar arrays and 5 row inputs
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret, name="gated_delta_rule",
    )(blocks, starts, jnp.where(seq >= 0, ends, starts), opens, loads, last.astype(jnp.int32),
      slots,
      by_head(q), by_head(k), by_head(v32), by_head(g)[..., None], by_head(beta)[..., None],
      state_pool)
    return by_head(out).astype(v.dtype), pool


def _dot(a, b, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), precision=EXACT,
                           preferred_element_type=jnp.float32)


def _unit_lower_inverse(a, eye, block: int):
    """(I + a)^-1 for `a` strictly lower triangular [block, block] (a^block = 0): the sum of
    (-a)^n for n < block as (I - a)(I + a^2)(I + a^4)..., log2(block) factors."""
    power = -a
    inverse = eye + power
    for _ in range(block.bit_length() - 2):  # a^2, a^4, ... a^(block / 2)
        power = _dot(power, power)
        inverse = _dot(inverse, eye + power)
    return inverse


def _chunk_kernel(blocks, starts, ends, opens, loads, lasts, slots,  # scalar prefetch (SMEM)
                  q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in, out_ref, pool_out,
                  state, sem, *, heads, values_per_key, block, delta):
    i = pl.program_id(0)

    @pl.when(opens[i] == 1)
    def _():  # padding rows stay zero
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(loads[i] == 1)
    def _():
        copy = pltpu.make_async_copy(pool_in.at[slots[i]], state, sem)
        copy.start()
        copy.wait()

    @pl.when(loads[i] == 2)
    def _():
        state[...] = jnp.zeros_like(state)

    @pl.when(ends[i] - starts[i] == 1)
    def _():  # a decode row: the recurrent form's three matrix-vector products a head
        _one_row(starts[i] - blocks[i] * block, q_ref, k_ref, v_ref, g_ref, beta_ref, out_ref,
                 state, heads=heads, values_per_key=values_per_key, delta=delta)

    @pl.when(ends[i] - starts[i] > 1)
    def _():
        _chunk(blocks[i] * block, starts[i], ends[i], q_ref, k_ref, v_ref, g_ref, beta_ref,
               out_ref, state, heads=heads, values_per_key=values_per_key, block=block,
               delta=delta)

    @pl.when(lasts[i] == 1)
    def _():
        copy = pltpu.make_async_copy(state, pool_out.at[slots[i]], sem)
        copy.start()
        copy.wait()


def _one_row(r, q_ref, k_ref, v_ref, g_ref, beta_ref, out_ref, state, *, heads,
             values_per_key, delta):
    """Row `r` of the block alone: S <- exp(g) S, then the delta rule's write (`delta`; else
    beta k v^T), o = q S."""
    for h in range(heads):  # static
        key = h // values_per_key
        q, k = q_ref[key, pl.ds(r, 1), :], k_ref[key, pl.ds(r, 1), :]  # [1, Dk]
        s = state[h] * jnp.exp(g_ref[h, pl.ds(r, 1), :])  # [Dk, Dv] x [1, 1]
        write = v_ref[h, pl.ds(r, 1), :]  # [1, Dv]
        if delta:
            write = write - _dot(k, s)
        s = s + _dot(k, write * beta_ref[h, pl.ds(r, 1), :], ((0,), (0,)))  # k^T write
        state[h] = s
        out_ref[h, pl.ds(r, 1), :] = _dot(q, s)


def _chunk(offset, start, end, q_ref, k_ref, v_ref, g_ref, beta_ref, out_ref, state, *, heads,
           values_per_key, block, delta):
    """Rows [start, end) of the block (at row `offset`) as one chunk (the module's docstring)."""
    row = lax.broadcasted_iota(jnp.int32, (block, block), 0)
    column = lax.broadcasted_iota(jnp.int32, (block, block), 1)
    on_or_below, eye = row >= column, (row == column).astype(jnp.float32)
    lower, ones = on_or_below.astype(jnp.float32), jnp.ones((block, block), jnp.float32)
    index = lax.broadcasted_iota(jnp.int32, (block, 1), 0) + offset
    live = (index >= start) & (index < end)  # [block, 1]: the item's rows

    for h in range(heads):  # static
        q, k = q_ref[h // values_per_key], k_ref[h // values_per_key]  # [block, Dk]
        v = v_ref[h]  # [block, Dv]
        g = jnp.where(live, g_ref[h], 0.0)  # [block, 1]: other rows decay by 1, write nothing
        beta = jnp.where(live, beta_ref[h], 0.0)
        c = _dot(lower, g)  # the cumulative log decay
        c_of_column = _dot(ones, eye * c)  # [i, j] = c_j (a transpose, as a matmul)
        decay = jnp.exp(jnp.where(on_or_below, c - c_of_column, -jnp.inf))
        s = state[h]
        if delta:
            a = jnp.where(row > column, beta * _dot(k, k, ((1,), (1,))) * decay, 0.0)
            inverse = _unit_lower_inverse(a, eye, block)
            w = _dot(inverse, beta * jnp.exp(c) * k)
            corrections = _dot(inverse, beta * v) - _dot(w, s)
        else:  # Mamba-2's scan: each row writes beta v as it is
            corrections = beta * v
        within = jnp.where(on_or_below, _dot(q, k, ((1,), (1,))) * decay, 0.0)
        out = _dot(q * jnp.exp(c), s) + _dot(within, corrections)
        last = c[block - 1:, :]  # [1, 1]: c at the block's last row (later rows add nothing)
        state[h] = s * jnp.exp(last) + _dot(k * jnp.exp(last - c), corrections, ((0,), (0,)))
        out_ref[h] = jnp.where(live, out, out_ref[h])
