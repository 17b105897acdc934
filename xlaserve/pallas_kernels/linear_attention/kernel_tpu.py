"""The gated delta rule of Gated DeltaNet layers as a Pallas TPU (Mosaic) kernel (issue 76), with
reference.py's contract (float32):

    out, pool = gated_delta_rule(q, k, v, g, beta, pool, state_slots, kv_lens, cu_q_lens,
                                 num_seqs, writes=None, interpret=False)

The recurrent form: each sequence's rows run in order with its state [Hv, Dk, Dv] (all value
heads: 2 MiB at Qwen3-Next's 32 heads of 128 x 128) in VMEM scratch, DMA'd in from the pool at
its first row (zeros where the step holds its prompt's first token) and back at its last, the
pool aliased in -> out and left in HBM. The reference's row loop moved the whole pool through
memory at each row.

The grid runs work items in order ("arbitrary": the state passes from item to item): an item is
the rows of one sequence within one block of `ROW_BLOCK` rows, so q, k, v and the outputs move
in blocks that Pallas pipelines, and a block that two sequences share is visited by consecutive
items (its output block stays in VMEM, written back once). Items of padding rows zero their
output; padding sequences have no items and touch no slot. q and k stay per key head
(normalized in XLA, not repeated to the value heads: 16 MB less traffic for a 512-row step of
Qwen3-Next). Per row and value head the rule is two matrix-vector products on the MXU (k S and
q S, at HIGHEST precision: float32) and the outer product k^T delta as a matmul contracting k's
row axis; decay exp(g) and beta are per-row scalars in SMEM. The heads are a static loop (32
unrolled for Qwen3-Next: 1.9 MB of code, 2.8 s to compile for v6e); not yet timed on a TPU.
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
    (Qwen3-Next at one device: 2 MiB of state, 3 MiB of blocks)."""
    state = heads * key_dim * value_dim * 4
    blocks = 2 * block * 4 * (2 * key_heads * key_dim + 2 * heads * value_dim)
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
                     writes=None, interpret=False, block_rows=ROW_BLOCK):
    """reference.gated_delta_rule on TPU: out [T, Hv, Dv] in v's dtype (padding rows zero), the
    pool (float32 [slots, Hv, Dk, Dv], updated in place) with each sequence's state after its last
    row, but where `writes` is 0 (reference.gated_delta_rule). `interpret`: False on a TPU, True to run it on the CPU (tests); `block_rows`: the most
    rows of a block."""
    if state_pool.dtype != jnp.float32:
        raise ValueError(f"the TPU gated delta rule keeps a float32 state pool, not "
                         f"{state_pool.dtype}")
    q, k, v32, g, beta = (x.astype(jnp.float32)
                          for x in reference.prepared_inputs(q, k, v, g, beta, repeat_keys=False))
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
    last = (seq >= 0) & (ends == cu_q_lens[s + 1]) & (reference.all_writes(writes, state_slots)[s] != 0)
    loads = jnp.where(fresh, 2, first.astype(jnp.int32))  # 0: carried, 1: from the pool, 2: zeros
    slots = state_slots[s]

    rows_of = lambda head_count, width: pl.BlockSpec((block, head_count, width),
                                         lambda i, b, *_: (b[i], 0, 0))
    scalars_of = pl.BlockSpec((block, heads), lambda i, b, *_: (b[i], 0),
                              memory_space=pltpu.SMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_rows_kernel, heads=heads, values_per_key=heads // key_heads,
                               block=block)
    out, pool = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, heads, value_dim), jnp.float32),
                   jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7, grid=(seq.shape[0],),
            in_specs=[rows_of(key_heads, key_dim), rows_of(key_heads, key_dim),
                      rows_of(heads, value_dim), scalars_of,
                      scalars_of, hbm],
            out_specs=[rows_of(heads, value_dim), hbm],
            scratch_shapes=[pltpu.VMEM((heads, key_dim, value_dim), jnp.float32),
                            pltpu.SemaphoreType.DMA(())]),
        input_output_aliases={12: 1},  # the pool: after the 7 scalar arrays and 5 row inputs
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret, name="gated_delta_rule",
    )(blocks, starts, jnp.where(seq >= 0, ends, starts), opens, loads, last.astype(jnp.int32),
      slots,
      q, k, v32, jnp.exp(g), beta, state_pool)
    return out.astype(v.dtype), pool


def _rows_kernel(blocks, starts, ends, opens, loads, lasts, slots,  # scalar prefetch (SMEM)
                 q_ref, k_ref, v_ref, decay_ref, beta_ref, pool_in, out_ref, pool_out,
                 state, sem, *, heads, values_per_key, block):
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

    offset = blocks[i] * block

    def row(r, carry):
        for h in range(heads):  # static: each head's rows of the block are [r, h] slices
            key = pl.ds(h // values_per_key, 1)  # the value head's key head
            q_row, k_row = q_ref[r, key, :], k_ref[r, key, :]  # [1, Dk]
            s = state[h] * decay_ref[r, h]
            remembered = jnp.dot(k_row, s, precision=EXACT, preferred_element_type=jnp.float32)
            delta = (v_ref[r, pl.ds(h, 1), :] - remembered) * beta_ref[r, h]  # [1, Dv]
            s = s + lax.dot_general(k_row, delta, (((0,), (0,)), ((), ())), precision=EXACT,
                                    preferred_element_type=jnp.float32)  # k^T delta
            state[h] = s
            out_ref[r, pl.ds(h, 1), :] = jnp.dot(q_row, s, precision=EXACT,
                                                 preferred_element_type=jnp.float32)
        return carry

    lax.fori_loop(starts[i] - offset, ends[i] - offset, row, 0)

    @pl.when(lasts[i] == 1)
    def _():
        copy = pltpu.make_async_copy(state, pool_out.at[slots[i]], sem)
        copy.start()
        copy.wait()
