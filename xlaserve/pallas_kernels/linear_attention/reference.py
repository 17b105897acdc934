"""The gated delta rule and its causal short convolution over ragged batches, in jnp: the
specification the CPU and Pallas kernels of hybrid linear-attention models (Qwen3.5, Qwen3-Next:
Gated DeltaNet layers) are checked against (issue 76).

A linear layer keeps no KV cache: each running request owns one slot of a state pool, holding per
value head the matrix state S [Dk, Dv] of the delta rule, and the last K - 1 inputs of the
convolution. A step's rows are ragged as the attention's are (`cu_q_lens`, `num_seqs`; rows past
cu_q_lens[num_seqs] are padding); sequence s reads and writes slot `state_slots[s]`, starting
from zeros where the step holds its first token (`kv_lens[s]` == its new tokens: no prefix) and
from the slot's state otherwise (a decode step, or a prompt's later chunk). `writes` (i32[S], or
None: all 1) 0 leaves a sequence's slot as it was: speculative decoding's verified rows, whose
state is the accepted drafts' (commit_accepted in model/linear_attention.py), not the row's.

The recurrence, per value head h (its q and k: head h // (Hv / Hk)), token by token:

    q <- l2norm(q) / sqrt(Dk),  k <- l2norm(k)
    S <- S * exp(g)                        g <= 0: the decay, in log space
    S <- S + k (beta (v - k^T S))^T        the delta rule: beta in (0, 1) the write's strength
    o <- S^T q

Mamba-2's scan (Nemotron-H, pallas_kernels/mamba2/) is this rule without the delta, `form`
"ssd" (state-space duality: gated linear attention), its q and k (C and B) as given:

    S <- S * exp(g);  S <- S + beta k v^T;  o <- S^T q

so every kernel of the rule runs it too.

transformers' `torch_recurrent_gated_delta_rule` (models/qwen3_next) is the same arithmetic on
one padded batch; its chunked form (`torch_chunk_gated_delta_rule`, flash-linear-attention's
algorithm) is `chunked_gated_delta_rule` here, on one sequence: what the kernels compute for a
prompt, a chunk of C tokens in a few matmuls, the sequence's state carried between chunks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

L2NORM_EPS = 1e-6  # transformers' and flash-linear-attention's


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, as transformers' `l2norm`."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def row_sequences(cu_q_lens: jax.Array, num_seqs: jax.Array, num_rows: int) -> jax.Array:
    """int32 [T]: the sequence each row belongs to, -1 for padding rows."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    return jnp.where(rows < cu_q_lens[num_seqs[0]], seq, -1)


def _heads_per_key(q: jax.Array, v: jax.Array) -> int:
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"{v.shape[1]} value heads do not share {q.shape[1]} key heads evenly")
    return v.shape[1] // q.shape[1]


def compute_dtype(x: jax.Array) -> jnp.dtype:
    """float32, or float64 for float64 inputs (the tests' exact reference)."""
    return jnp.promote_types(x.dtype, jnp.float32)


FORMS = ("delta", "ssd")


def prepared_inputs(q, k, v, g, beta, repeat_keys: bool = True, form: str = "delta"):
    """q (normalized, scaled) and k (normalized; both as given in form "ssd") repeated to the
    value heads (`repeat_keys`; else left per key head, the Pallas kernels reading head
    h // (Hv / Hk)), v, g, beta, all in the compute dtype: what each form of the rule (and the
    CPU kernel) takes."""
    if form not in FORMS:
        raise ValueError(f"the gated delta rule's form is one of {FORMS}, not {form!r}")
    ratio, dtype = _heads_per_key(q, v), compute_dtype(v)
    q, k = (x.astype(dtype) for x in (q, k))
    if form == "delta":
        q, k = l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)
    q, k = (jnp.repeat(x, ratio if repeat_keys else 1, axis=1) for x in (q, k))
    return q, k, v.astype(dtype), g.astype(dtype), beta.astype(dtype)


def pallas_inputs(q, k, v, g, beta, state_pool, form: str, kernel: str):
    """The Pallas kernels' (`kernel`: "TPU", "GPU") inputs: `prepared_inputs` per key head, in
    float32; ValueError for a state pool that is not float32."""
    if state_pool.dtype != jnp.float32:
        raise ValueError(f"the {kernel} gated delta rule keeps a float32 state pool, not "
                         f"{state_pool.dtype}")
    return tuple(x.astype(jnp.float32)
                 for x in prepared_inputs(q, k, v, g, beta, repeat_keys=False, form=form))


def delta_rule_update(state, k, v, g, beta, form: str = "delta"):
    """The state [..., Hv, Dk, Dv] after one token: k [..., Hv, Dk] (normalized, per value
    head), v [..., Hv, Dv], g and beta [..., Hv]; without the delta in form "ssd"."""
    state = state * jnp.exp(g)[..., None, None]
    if form == "delta":
        v = v - jnp.einsum("...hkv,...hk->...hv", state, k)  # what k already reads
    return state + k[..., :, None] * (v * beta[..., None])[..., None, :]


def gated_delta_rule(q, k, v, g, beta, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                     writes=None, form: str = "delta"):
    """The recurrent form over a ragged step, token by token.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state_pool float32 [slots, Hv, Dk, Dv];
    state_slots, kv_lens int32 [S]; cu_q_lens int32 [S + 1]; num_seqs int32 [1]; writes int32
    [S] or None; `form` "delta" or "ssd" (the module's docstring).
    Returns (out [T, Hv, Dv] in v's dtype, padding rows zero; the pool with each sequence's
    state after its last row)."""
    q, k, v32, g, beta = prepared_inputs(*map(jnp.asarray, (q, k, v, g, beta)), form=form)

    def token(state, t):
        state = delta_rule_update(state, k[t], v32[t], g[t], beta[t], form)
        return state, jnp.einsum("hkv,hk->hv", state, q[t])

    pool, out = scan_rows(token, state_pool.astype(v32.dtype), q.shape[0], state_slots, kv_lens,
                          cu_q_lens, num_seqs, writes)
    return out.astype(v.dtype), pool.astype(state_pool.dtype)


def all_writes(writes, state_slots) -> jax.Array:
    """`writes` as int32 [S], all 1 where None."""
    if writes is None:
        return jnp.ones(jnp.shape(state_slots), jnp.int32)
    return jnp.asarray(writes, jnp.int32)


def scan_rows(row_step, pool, num_rows: int, state_slots, kv_lens, cu_q_lens, num_seqs,
              writes=None):
    """`row_step(state, t) -> (state, out)` over a ragged step's rows in order, each on its
    sequence's slot of `pool` (zeros at a prompt's first row: no prefix before the step).
    A sequence whose `writes` is 0 carries its state from row to row outside the pool, which
    keeps the slot's. Returns (the pool, outs [T, ...] with padding rows zero)."""
    state_slots, kv_lens, cu_q_lens, num_seqs = map(jnp.asarray, (state_slots, kv_lens,
                                                                  cu_q_lens, num_seqs))
    writes = all_writes(writes, state_slots)
    seq_of_row = row_sequences(cu_q_lens, num_seqs, num_rows)

    def row(carry, t):
        pool, carried = carry  # carried: the state of a sequence that does not write its slot
        seq = seq_of_row[t]
        live = seq >= 0
        s = jnp.maximum(seq, 0)
        slot = state_slots[s]
        first_row = t == cu_q_lens[s]
        first_of_prompt = first_row & (kv_lens[s] == cu_q_lens[s + 1] - cu_q_lens[s])
        writing = writes[s] != 0
        before = jnp.where(writing | first_row, pool[slot], carried)
        state, out = row_step(jnp.where(first_of_prompt, 0.0, before), t)
        pool = pool.at[slot].set(jnp.where(live & writing, state, pool[slot]))
        return (pool, state), jnp.where(live, out, 0.0)

    (pool, _), out = lax.scan(row, (pool, jnp.zeros_like(pool[0])), jnp.arange(num_rows))
    return pool, out


def chunked_gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size: int = 64):
    """One sequence in chunks of `chunk_size` tokens: q, k [L, Hk, Dk], v [L, Hv, Dv], g, beta
    [L, Hv], initial_state [Hv, Dk, Dv] -> (out [L, Hv, Dv], final state), in the compute dtype.

    Within a chunk, with c the cumulative log decay from the chunk's start and S the state it
    starts from, the chunk's writes are the solution of one unit lower-triangular system (the
    UT transform, as transformers' and flash-linear-attention's chunked forms):
        A[i, j] = beta_i k_i . k_j exp(c_i - c_j), j < i
        u = (I + A)^-1 (beta v),  w = (I + A)^-1 (beta exp(c) k)
        v' = u - w S                                 (the corrections the writes make)
        o = exp(c) q S + tril((q . k) exp(c_i - c_j)) v'
        S <- exp(c_last) S + (exp(c_last - c) k)^T v'"""
    length = q.shape[0]
    q, k, v, g, beta = prepared_inputs(q, k, v, g, beta)
    pad = -length % chunk_size
    dtype = q.dtype
    q, k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x, ((0, pad), (0, 0))) for x in (g, beta))
    chunks = (length + pad) // chunk_size
    # [chunks, H, C, D]: each head's chunk a matrix
    as_chunks = lambda x: jnp.moveaxis(x.reshape(chunks, chunk_size, *x.shape[1:]), 1, 2)
    q, k, v = as_chunks(q), as_chunks(k), as_chunks(v)
    g, beta = as_chunks(g[..., None])[..., 0], as_chunks(beta[..., None])[..., 0]
    c = jnp.cumsum(g, axis=-1)  # [chunks, H, C]
    below = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    on_or_below = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    decay = jnp.exp(jnp.where(on_or_below, c[..., :, None] - c[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    system = jnp.eye(chunk_size, dtype=dtype) + jnp.where(below, k_beta @ jnp.swapaxes(k, -1, -2) * decay, 0)
    u = solve_triangular(system, v * beta[..., None], lower=True, unit_diagonal=True)
    w = solve_triangular(system, k_beta * jnp.exp(c)[..., None], lower=True, unit_diagonal=True)
    within = (q @ jnp.swapaxes(k, -1, -2)) * decay
    q_decayed = q * jnp.exp(c)[..., None]
    last = c[..., -1:]
    k_decayed = k * jnp.exp(last - c)[..., None]

    def chunk(state, i):
        corrections = u[i] - w[i] @ state
        out = q_decayed[i] @ state + within[i] @ corrections
        state = state * jnp.exp(last[i])[..., None] + jnp.swapaxes(k_decayed[i], -1, -2) @ corrections
        return state, out

    state, out = lax.scan(chunk, initial_state.astype(dtype), jnp.arange(chunks))
    out = jnp.moveaxis(out, 2, 1)  # [chunks, C, H, Dv]
    out = out.reshape(chunks * chunk_size, *out.shape[2:])[:length]
    return out, state


def causal_conv1d(x, weight, bias, conv_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                  activation: str | None = "silu", writes=None):
    """The depthwise causal convolution over a ragged step: x [T, C], weight [C, W], bias [C] or
    None, conv_pool [slots, W - 1, C] (a sequence's last W - 1 inputs, oldest first; zeros before
    its first token; the channels last, as x's rows: on TPU a [C, W - 1] window was tiled with 3
    of 128 lanes used, and relaid out each step). Row t of sequence s: sum_j weight[:, j] *
    input[t - (W - 1) + j], the inputs before the step's first row read from the slot. Returns
    (out [T, C] in x's dtype, padding rows zero; the pool with each sequence's last W - 1
    inputs, but where `writes` (int32 [S] or None) is 0).

    No loop over the rows: each row's W - 1 earlier inputs are gathered, from the step's rows or
    from its sequence's window (the row loop was a scan over the step, a window update a row)."""
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    state_slots, kv_lens, cu_q_lens, num_seqs = map(jnp.asarray, (state_slots, kv_lens,
                                                                  cu_q_lens, num_seqs))
    dtype, rows, width = compute_dtype(x), x.shape[0], weight.shape[1]
    x32, taps = x.astype(dtype), weight.astype(dtype)
    seq_of_row = row_sequences(cu_q_lens, num_seqs, rows)
    live = seq_of_row >= 0
    seq = jnp.maximum(seq_of_row, 0)
    out = _inputs_before(x32, conv_pool, seq, jnp.arange(rows), state_slots, kv_lens, cu_q_lens,
                         width, dtype)  # [T, W, C]: row t - (W - 1) + j at j
    out = jnp.einsum("twc,cw->tc", out, taps)
    if bias is not None:
        out = out + bias.astype(dtype)
    if activation == "silu":
        out = jax.nn.silu(out)
    elif activation is not None:
        raise ValueError(f"convolution activation {activation!r} is not built (silu or none)")
    out = jnp.where(live[:, None], out, 0.0)
    # Each sequence's new window: its inputs before the row after its last.
    seqs = jnp.arange(state_slots.shape[0])
    windows = _inputs_before(x32, conv_pool, seqs, cu_q_lens[1:], state_slots, kv_lens,
                             cu_q_lens, width, dtype)[:, :-1]
    targets = jnp.where((seqs < num_seqs[0]) & (all_writes(writes, state_slots) != 0),
                        state_slots, conv_pool.shape[0])  # others: dropped
    # The windows whole before the pool is written: fused into the scatter, their reads of the
    # pool made the H100 step copy it (6.4 MB a layer of Qwen3-Next's at tp 1) to write in place.
    windows = jax.lax.optimization_barrier(windows.astype(conv_pool.dtype))
    pool = conv_pool.at[targets].set(windows, mode="drop")
    return out.astype(x.dtype), pool


def _inputs_before(x32, conv_pool, seq, row, state_slots, kv_lens, cu_q_lens, width: int, dtype):
    """[N, W, C]: for each (sequence `seq`, row `row`), the inputs at rows row - (W - 1) ..
    row (the last is the row's own, or past the sequence's end: only the W - 1 before are
    read then): the step's rows of the sequence, before them its window (zeros at a prompt's
    start)."""
    start = cu_q_lens[seq]
    fresh = kv_lens[seq] == cu_q_lens[seq + 1] - start
    window = jnp.where(fresh[:, None, None], 0.0,
                       conv_pool[state_slots[seq]].astype(dtype))  # [N, W - 1, C]
    back = jnp.arange(width - 1, -1, -1)  # rows back from `row`, oldest first
    source = row[:, None] - back[None, :]  # [N, W]
    from_rows = x32[jnp.clip(source, 0, x32.shape[0] - 1)]
    before = jnp.clip(width - 1 - (start[:, None] - source), 0, width - 2)
    from_window = jnp.take_along_axis(window, before[..., None], axis=1)
    return jnp.where((source >= start[:, None])[..., None], from_rows, from_window)
