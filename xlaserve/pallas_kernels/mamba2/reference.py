"""Mamba-2's selective state-space scan (SSD) over a ragged step: Nemotron-H's linear layers
(model/mamba2.py). It is the gated delta rule's recurrence without the delta (gated linear
attention: pallas_kernels/linear_attention/reference.py, form "ssd"), so every kernel of that rule
runs it: the jnp reference here and on a CPU mesh, the native CPU kernel, the Pallas TPU kernel
(a prompt's rows in chunks of matmuls) and the GPU one (runtime/executor/kernels.py).

Each running request owns one slot of a state pool: per head h, the matrix state
S [state N, head_dim P] (the rule's [Dk, Dv]: B and C are its k and q). A step's rows are ragged
as attention's are (`cu_q_lens`, `num_seqs`; rows past cu_q_lens[num_seqs] are padding);
sequence s reads and writes slot `state_slots[s]`, from zeros where the step holds its first
token (`kv_lens[s]` == its new tokens: no prefix), from the slot otherwise. Per head h (its B
and C: group h // (H / G), as a value head's key head), token by token:

    S <- exp(dt A) S + B (dt x)^T            dt > 0 (softplus'd, clamped), A < 0
    y <- S^T C + D x

i.e. the rule with q = C, k = B, v = dt x, g = dt A, beta = 1. transformers'
`mamba2_selective_state_update` (models/nemotron_h) is this for one token (its state [P, N], the
transpose), its `mamba2_chunk_scan` the same recurrence in chunks.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from xlaserve.pallas_kernels.linear_attention.reference import gated_delta_rule


def through_rule(rule):
    """Mamba-2's scan over a ragged step run by `rule` (a gated delta rule's signature, with its
    `form`):

        mamba2_ssm(x, dt, A, B, C, D, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                   writes=None)

    x [T, H, P]; dt [T, H] (softplus'd and clamped); A, D [H] (A = -exp(A_log)); B, C [T, G, N];
    state_pool float32 [slots, H, N, P]; state_slots, kv_lens int32 [S]; cu_q_lens int32
    [S + 1]; num_seqs int32 [1]; writes int32 [S] or None (0 leaves a sequence's slot as it was:
    a speculative verified row's). Returns (y [T, H, P] in the compute dtype (float32, or
    float64 for float64 inputs), padding rows zero; the pool with each sequence's state after
    its last row)."""

    @functools.wraps(rule)
    def mamba2_ssm(x, dt, A, B, C, D, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                   writes=None):
        dtype = jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)  # float64 stays: tests'
        x, dt, A, B, C, D = (jnp.asarray(a).astype(dtype) for a in (x, dt, A, B, C, D))
        y, pool = rule(C, B, dt[..., None] * x, dt * A, jnp.ones_like(dt), state_pool,
                       state_slots, kv_lens, cu_q_lens, num_seqs, writes, form="ssd")
        live = y.astype(dtype) + D[:, None] * x  # padding rows: x is zero there too
        return live, pool

    return mamba2_ssm


mamba2_ssm = through_rule(gated_delta_rule)


def by_head(groups, heads: int):
    """[..., G, N] -> [..., H, N]: each head its group's row (head h: group h // (H / G))."""
    return jnp.repeat(groups, heads // groups.shape[-2], axis=-2)
