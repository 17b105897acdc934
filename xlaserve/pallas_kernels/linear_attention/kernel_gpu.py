"""The gated delta rule of Gated DeltaNet layers as a Pallas GPU (Triton) kernel (issue 76), with
reference.py's contract (float32):

    out, pool = gated_delta_rule(q, k, v, g, beta, pool, state_slots, kv_lens, cu_q_lens,
                                 num_seqs, writes=None, interpret=False)

q and k stay per key head (normalized in XLA, not repeated to the value heads: 16 MB less
temporary memory and traffic for a 512-row step of Qwen3-Next, 16 key heads, 32 value heads).
The recurrent form, as flash-linear-attention's fused recurrent kernel: one program per
(sequence, value head, block of `VALUE_BLOCK` value columns) keeps its part of the state
[Dk, VALUE_BLOCK] in registers over the sequence's rows, read from its slot once (zeros where
the step holds its prompt's first token) and written back once; the pool is aliased in -> out.
The reference's row loop moved the whole pool through memory at each row. The columns of the
state are independent in the rule (k S, the delta and q S are per column), so splitting Dv
only repeats the row's q and k reads. Padding sequences' programs do nothing; the output starts
as zeros (aliased too), so padding rows stay zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.pallas_kernels.linear_attention import reference

VALUE_BLOCK = 32  # state columns a program holds: [128, 32] float32 is 32 registers a thread
NUM_WARPS = 4


def check_shapes(key_dim: int, value_dim: int, value_block: int = VALUE_BLOCK) -> int:
    """The value block for these head sizes; ValueError where Triton cannot tile them (its
    blocks are powers of two)."""
    for name, size in (("key head dim", key_dim), ("value head dim", value_dim),
                       ("value block", value_block)):
        if size & (size - 1):
            raise ValueError(f"the GPU gated delta rule needs a power-of-two {name}, not {size}")
    return min(value_block, value_dim)


def gated_delta_rule(q, k, v, g, beta, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                     writes=None, form: str = "delta", interpret=False,
                     value_block=VALUE_BLOCK):
    """reference.gated_delta_rule on GPU: out [T, Hv, Dv] in v's dtype (padding rows zero), the
    pool (float32 [slots, Hv, Dk, Dv], updated in place) with each sequence's state after its last
    row, but where `writes` is 0 (reference.gated_delta_rule); `form` "ssd": Mamba-2's scan,
    without the delta (reference.py). `interpret`: False on a GPU, True to run it on the CPU (tests); `value_block`: the most
    state columns a program holds."""
    if state_pool.dtype != jnp.float32:
        raise ValueError(f"the GPU gated delta rule keeps a float32 state pool, not "
                         f"{state_pool.dtype}")
    q, k, v32, g, beta = (x.astype(jnp.float32)
                          for x in reference.prepared_inputs(q, k, v, g, beta, repeat_keys=False,
                                                             form=form))
    rows, heads, value_dim = v32.shape
    key_dim = k.shape[-1]
    value_block = check_shapes(key_dim, value_dim, value_block)
    metadata = [jnp.asarray(x, jnp.int32) for x in (state_slots, kv_lens, cu_q_lens, num_seqs)]
    metadata.append(reference.all_writes(writes, state_slots))
    kernel = functools.partial(_sequence_kernel, value_block=value_block,
                               values_per_key=heads // k.shape[1], delta=form == "delta")
    out, pool = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, heads, value_dim), jnp.float32),
                   jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)),
        grid=(metadata[0].shape[0], heads, value_dim // value_block),
        input_output_aliases={10: 0, 11: 1},  # zeros -> out, the pool
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="gated_delta_rule",
    )(*metadata, q, k, v32, jnp.exp(g), beta, jnp.zeros((rows, heads, value_dim), jnp.float32),
      state_pool)
    return out.astype(v.dtype), pool


def _sequence_kernel(slots_ref, kv_lens_ref, cu_ref, num_seqs_ref, writes_ref, q_ref, k_ref,
                     v_ref, decay_ref, beta_ref, zeros_ref, pool_in, out_ref, pool_out, *, value_block,
                     values_per_key, delta):
    del zeros_ref  # the output's initial value (aliased)
    s, h = pl.program_id(0), pl.program_id(1)
    key_head = h // values_per_key
    columns = pl.ds(pl.program_id(2) * value_block, value_block)
    start, end = cu_ref[s], cu_ref[s + 1]

    @pl.when((s < num_seqs_ref[0]) & (end > start))
    def _():
        slot = slots_ref[s]
        fresh = kv_lens_ref[s] == end - start  # no prefix: the state starts from zeros
        state = jnp.where(fresh, 0.0, pool_in[slot, h, :, columns])  # [Dk, value_block]

        def row(t, state):
            k_row = k_ref[t, key_head, :]
            state = state * decay_ref[t, h]
            write = v_ref[t, h, columns]
            if delta:  # what k already reads (not in Mamba-2's scan)
                write = write - jnp.sum(k_row[:, None] * state, axis=0)
            state = state + k_row[:, None] * (write * beta_ref[t, h])[None, :]
            out_ref[t, h, columns] = jnp.sum(q_ref[t, key_head, :][:, None] * state, axis=0)
            return state

        state = lax.fori_loop(start, end, row, state)

        @pl.when(writes_ref[s] != 0)  # a verified row's slot keeps its state (reference.py)
        def _():
            pool_out[slot, h, :, columns] = state
