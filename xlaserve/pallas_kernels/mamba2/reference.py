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


def ssm_update(state, x, dt, A, B):
    """The state [..., H, P, N] after one token: x [..., H, P], dt [..., H], A [H], B [..., H, N]
    (each head's group's): S <- exp(dt A) S + dt x B^T. The write formed a row at a time:
    [T, H, P, N] whole is too large."""
    written = (dt[..., None] * x)[..., None] * B[..., None, :]
    return state * jnp.exp(dt * A)[..., None, None] + written


def mamba2_ssm(x, dt, A, B, C, D, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
               writes=None):
    """The recurrent form over a ragged step.

    x [T, H, P]; dt [T, H] (softplus'd and clamped); A, D [H] (A = -exp(A_log)); B, C [T, G, N];
    state_pool float32 [slots, H, P, N]; state_slots, kv_lens int32 [S]; cu_q_lens int32
    [S + 1]; num_seqs int32 [1]; writes int32 [S] or None (linear_attention/reference.py: 0
    leaves a sequence's slot as it was, a speculative verified row's). Returns (y [T, H, P] in
    the compute dtype (float32, or float64 for float64 inputs), padding rows zero; the pool with
    each sequence's state after its last row)."""
    dtype = jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)  # float64 stays: the tests'
    x, dt, A, B, C, D = (jnp.asarray(a).astype(dtype) for a in (x, dt, A, B, C, D))
    B, C = (by_head(a, x.shape[1]) for a in (B, C))  # [T, H, N]

    def token(state, t):
        state = ssm_update(state, x[t], dt[t], A, B[t])
        return state, jnp.einsum("hpn,hn->hp", state, C[t]) + D[:, None] * x[t]

    pool, y = scan_rows(token, state_pool.astype(dtype), x.shape[0], state_slots, kv_lens,
                        cu_q_lens, num_seqs, writes)
    return y, pool.astype(state_pool.dtype)


def by_head(groups, heads: int):
    """[..., G, N] -> [..., H, N]: each head its group's row (head h: group h // (H / G))."""
    return jnp.repeat(groups, heads // groups.shape[-2], axis=-2)
