"""Mamba-2's selective state-space scan (SSD) over a ragged step, in jnp: the specification of
Nemotron-H's linear layers (model/mamba2.py), and for now what every platform runs (no Pallas or
native kernel yet: on TPU and GPU this scan is a loop over the step's rows, each reading and
writing one slot of the pool).

Each running request owns one slot of a state pool: per head h, the matrix state
S [head_dim P, state N]. A step's rows are ragged as attention's are (`cu_q_lens`, `num_seqs`;
rows past cu_q_lens[num_seqs] are padding); sequence s reads and writes slot `state_slots[s]`,
from zeros where the step holds its first token (`kv_lens[s]` == its new tokens: no prefix),
from the slot otherwise. Per head h (its B and C: group h // (H / G)), token by token:

    S <- exp(dt A) S + dt x B^T            dt > 0 (softplus'd, clamped), A < 0
    y <- S C + D x

transformers' `mamba2_selective_state_update` (models/nemotron_h) is this for one token, its
`mamba2_chunk_scan` the same recurrence in chunks.
"""
from __future__ import annotations

import jax.numpy as jnp

from xlaserve.pallas_kernels.linear_attention.reference import scan_rows


def mamba2_ssm(x, dt, A, B, C, D, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs):
    """The recurrent form over a ragged step.

    x [T, H, P]; dt [T, H] (softplus'd and clamped); A, D [H] (A = -exp(A_log)); B, C [T, G, N];
    state_pool float32 [slots, H, P, N]; state_slots, kv_lens int32 [S]; cu_q_lens int32
    [S + 1]; num_seqs int32 [1]. Returns (y [T, H, P] in the compute dtype (float32, or
    float64 for float64 inputs), padding rows zero; the pool with each sequence's state after
    its last row)."""
    dtype = jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)  # float64 stays: the tests'
    x, dt, A, B, C, D = (jnp.asarray(a).astype(dtype) for a in (x, dt, A, B, C, D))
    per_group = x.shape[1] // B.shape[1]
    B, C = (jnp.repeat(a, per_group, axis=1) for a in (B, C))  # [T, H, N]
    decay = jnp.exp(dt * A)  # [T, H]

    def token(state, t):  # the write formed a row at a time: [T, H, P, N] whole is too large
        written = (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        state = state * decay[t][:, None, None] + written
        return state, jnp.einsum("hpn,hn->hp", state, C[t]) + D[:, None] * x[t]

    pool, y = scan_rows(token, state_pool.astype(dtype), x.shape[0], state_slots, kv_lens,
                        cu_q_lens, num_seqs)
    return y, pool.astype(state_pool.dtype)
