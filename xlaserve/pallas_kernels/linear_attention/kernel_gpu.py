"""The gated delta rule of Gated DeltaNet layers as a Pallas GPU (Triton) kernel (issue 76), with
reference.py's contract (float32):

    out, pool = gated_delta_rule(q, k, v, g, beta, pool, state_slots, kv_lens, cu_q_lens,
                                 num_seqs, writes=None, interpret=False)

q and k stay per key head (normalized in XLA, not repeated to the value heads: 16 MB less
temporary memory and traffic for a 512-row step of Qwen3-Next, 16 key heads, 32 value heads).
One program per (sequence, value head, block of `VALUE_BLOCK` value columns) keeps its part of
the state [Dk, VALUE_BLOCK] in registers over the sequence's rows, read from its slot once
(zeros where the step holds its prompt's first token) and written back once; the pool is
aliased in -> out. The columns of the state are independent in the rule (k S, the delta and
q S are per column), so splitting Dv only repeats the row's q and k reads (and a chunk's
solve, below). A sequence of one row (a decode row) runs the recurrent form, as
flash-linear-attention's fused recurrent kernel; longer ones (a prompt's chunk, a verified row)
the chunked form (reference.chunked_gated_delta_rule, the TPU kernel's): `CHUNK` rows at a time,
their writes solved together in tensor-core matmuls, (I + A)^-1 as a product of log2(CHUNK)
factors, every matmul in IEEE float32 (not TF32). Rows past a sequence's end in its last chunk
decay by 1 and write nothing; the inputs are padded by a chunk so that no load leaves them, and
the outputs are stored under a mask. Padding sequences' programs do nothing; the output starts
as zeros (aliased too), so padding rows stay zero. Form "ssd" (Mamba-2's scan, reference.py) is
the same without the delta.
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
CHUNK = 16  # rows of the chunked form: Triton's matmuls take 16 at least
EXACT = lax.Precision.HIGHEST  # IEEE float32 on the tensor cores, not TF32


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
                     value_block=VALUE_BLOCK, chunk=CHUNK):
    """reference.gated_delta_rule on GPU: out [T, Hv, Dv] in v's dtype (padding rows zero), the
    pool (float32 [slots, Hv, Dk, Dv], updated in place) with each sequence's state after its last
    row, but where `writes` is 0 (reference.gated_delta_rule); `form` "ssd": Mamba-2's scan,
    without the delta (reference.py). `interpret`: False on a GPU, True to run it on the CPU
    (tests); `value_block`: the most state columns a program holds; `chunk`: rows of the
    chunked form (a power of two, 16 at least on a GPU)."""
    q, k, v32, g, beta = reference.pallas_inputs(q, k, v, g, beta, state_pool, form, "GPU")
    rows, heads, value_dim = v32.shape
    key_dim = k.shape[-1]
    value_block = check_shapes(key_dim, value_dim, value_block)
    metadata = [jnp.asarray(x, jnp.int32) for x in (state_slots, kv_lens, cu_q_lens, num_seqs)]
    metadata.append(reference.all_writes(writes, state_slots))
    # A chunk of zero rows after the last: a sequence's last chunk never reads past the inputs.
    pad = lambda x: jnp.pad(x, ((0, chunk),) + ((0, 0),) * (x.ndim - 1))
    kernel = functools.partial(_sequence_kernel, value_block=value_block,
                               values_per_key=heads // k.shape[1], delta=form == "delta",
                               chunk=chunk)
    out, pool = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows + chunk, heads, value_dim), jnp.float32),
                   jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)),
        grid=(metadata[0].shape[0], heads, value_dim // value_block),
        input_output_aliases={10: 0, 11: 1},  # zeros -> out, the pool
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="gated_delta_rule",
    )(*metadata, pad(q), pad(k), pad(v32), pad(g), pad(beta),
      jnp.zeros((rows + chunk, heads, value_dim), jnp.float32), state_pool)
    return out[:rows].astype(v.dtype), pool


def _sequence_kernel(slots_ref, kv_lens_ref, cu_ref, num_seqs_ref, writes_ref, q_ref, k_ref,
                     v_ref, g_ref, beta_ref, zeros_ref, pool_in, out_ref, pool_out, *,
                     value_block, values_per_key, delta, chunk):
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

        def row(t, state):  # the recurrent form
            k_row = k_ref[t, key_head, :]
            state = state * jnp.exp(g_ref[t, h])
            write = v_ref[t, h, columns]
            if delta:  # what k already reads (not in Mamba-2's scan)
                write = write - jnp.sum(k_row[:, None] * state, axis=0)
            state = state + k_row[:, None] * (write * beta_ref[t, h])[None, :]
            out_ref[t, h, columns] = jnp.sum(q_ref[t, key_head, :][:, None] * state, axis=0)
            return state

        def chunk_at(i, state):  # the chunked form, rows start + i * chunk ...
            first = start + i * chunk
            return _chunk(first, end, state, q_ref, k_ref, v_ref, g_ref, beta_ref, out_ref,
                          key_head, h, columns, delta=delta, chunk=chunk)

        state = lax.cond(end - start == 1, lambda: row(start, state),
                         lambda: lax.fori_loop(0, pl.cdiv(end - start, chunk), chunk_at, state))

        @pl.when(writes_ref[s] != 0)  # a verified row's slot keeps its state (reference.py)
        def _():
            pool_out[slot, h, :, columns] = state


def _dot(a, b):
    return jnp.dot(a, b, precision=EXACT, preferred_element_type=jnp.float32)


def _chunk(first, end, state, q_ref, k_ref, v_ref, g_ref, beta_ref, out_ref, key_head, h,
           columns, *, delta, chunk):
    """The state after rows [first, min(first + chunk, end)) as one chunk, their outputs
    stored (reference.chunked_gated_delta_rule; the TPU kernel's `_chunk`)."""
    rows = pl.ds(first, chunk)
    index = first + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    live = index < end
    q, k = q_ref[rows, key_head, :], k_ref[rows, key_head, :]  # [chunk, Dk]
    v = v_ref[rows, h, columns]  # [chunk, value_block]
    g = jnp.where(live, g_ref[rows, h], 0.0)  # rows past the end decay by 1, write nothing
    beta = jnp.where(live, beta_ref[rows, h], 0.0)
    row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    column = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    on_or_below = row >= column
    c = jnp.sum(jnp.where(on_or_below, g[None, :], 0.0), axis=1)  # the cumulative log decay
    decay = jnp.exp(jnp.where(on_or_below, c[:, None] - c[None, :], -jnp.inf))
    if delta:
        eye = (row == column).astype(jnp.float32)
        power = -jnp.where(row > column, beta[:, None] * _dot(k, k.T) * decay, 0.0)
        inverse = eye + power  # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A nilpotent
        for _ in range(chunk.bit_length() - 2):
            power = _dot(power, power)
            inverse = _dot(inverse, eye + power)
        w = _dot(inverse, (beta * jnp.exp(c))[:, None] * k)
        corrections = _dot(inverse, beta[:, None] * v) - _dot(w, state)
    else:  # Mamba-2's scan: each row writes beta v as it is
        corrections = beta[:, None] * v
    within = jnp.where(on_or_below, _dot(q, k.T) * decay, 0.0)
    out = _dot(jnp.exp(c)[:, None] * q, state) + _dot(within, corrections)
    plgpu.store(out_ref.at[rows, h, columns], out, mask=live[:, None])
    last = jnp.min(c)  # c at the chunk's last live row: g <= 0, later rows add nothing
    return (state * jnp.exp(last)
            + _dot((jnp.exp(last - c)[:, None] * k).T, corrections))
