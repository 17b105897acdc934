"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (issue 76): three of every
four layers of those models, the fourth a gated full-attention layer.

    qkv = conv1d(x W_qkv) (causal, depthwise, W = 4 wide, then SiLU), split into q, k [Hk, Dk]
          and v [Hv, Dv]
    beta = sigmoid(x W_b),  g = -exp(A_log) softplus(x W_a + dt_bias)       per value head
    o = gated_delta_rule(q, k, v, g, beta)        (Kernels.gated_delta_rule: pallas_kernels/
                                                   linear_attention/, its reference and CPU kernel)
    y = (RMSNorm(o) * silu(x W_z)) W_out           the norm per value head, gated

Its state is not a KV cache: per request, a slot of two pools (`LinearState`): the convolution's
last W - 1 inputs and each value head's [Dk, Dv] matrix. A step's caches hold each linear layer's
pools after the KV pool's arrays (ModelConfig.cache_slot); sequence s reads and writes the slot
of its request (`AttentionMetadata.state_slots`), from zeros at a prompt's first token.

Speculative decoding: a verified row (`[t, d1, ..., dk]`) runs with its slot left as it was
(`VerifiedRows.writes`), its rows' inputs kept (`PendingRows`); once the step knows how many
drafts were accepted, `commit_accepted` runs the rule over those tokens alone from the slot's
state and writes the result (the convolution's window likewise). Recomputing the accepted rows'
updates from their kept inputs costs the rule's arithmetic of up to k + 1 rows and their inputs'
bytes (S x (k + 1) rows a layer), where keeping a state after every draft (vLLM's way) would hold
k more slots a request.

Layout: everything by key head, so that tensor parallelism splits the layer by head as it splits
attention (model/sharding.py), with no exchange but out_proj's sum: value head h belongs to key
head h // (Hv / Hk), so a device's key heads own a contiguous run of value heads. `in_proj_qkv`
[hidden, Hk, 2 Dk + (Hv / Hk) Dv] holds per key head its q, its k and its value heads' v (the
convolution's channels in that order, `conv_weight` [Hk, same, W]); `in_proj_z` [hidden, Hv, Dv];
`in_proj_ba` [hidden, 2, Hv] (b, then a: one matmul); `out_proj` [Hv, Dv, hidden]. Checkpoints
keep q | k | v whole (Qwen3.5) or grouped with z (Qwen3-Next, `from_grouped_projections`):
weights/linear_attention_layout.py reorders them once at load.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.model.config.linear_attention_config import LinearAttentionConfig
from xlaserve.model.layers import Kernels, init_weight, linear, matmul_input_dtype, project
from xlaserve.pallas_kernels.linear_attention.reference import (causal_conv1d,
                                                                 delta_rule_update,
                                                                 prepared_inputs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifiedRows:
    """A speculative step's linear-layer bookkeeping (AttentionMetadata.verified_rows; made by
    runtime/executor/verified_rows.StateRollback): `writes` i32[S], 1 where a sequence's slot
    takes its state after the step's rows (a prompt chunk, a plain decode), 0 where the slot
    keeps the state before them (a verified row); `rows` i32[S, W], each sequence's first W rows
    (W: a verified row's tokens at most), whose inputs a layer keeps (`PendingRows`)."""

    writes: jax.Array
    rows: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PendingRows:
    """A layer's inputs of `VerifiedRows.rows` ([S, W, ...]): the convolution's `raw` inputs
    (the projection's rows, model dtype) and the rule's k, v (after the convolution), g and
    beta."""

    raw: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


@dataclasses.dataclass
class LinearState:
    """One layer's state pools, float32: `conv` [slots, W - 1, Hk, channels] (the convolution's
    inputs before a request's next row, oldest first, each key head's channels) and `delta`
    [slots, Hv, Dk, Dv] (the delta rule's matrices). A request owns one slot of both, in every
    linear layer. `pending`: in a speculative step, between the forward and `commit_accepted`,
    the verified rows' inputs (else None)."""

    conv: jax.Array
    delta: jax.Array
    pending: PendingRows | None = None

    def commit_accepted(self, kept_lens, slots, verified) -> "LinearState":
        return commit_accepted(self, kept_lens, slots, verified)


jax.tree_util.register_dataclass(LinearState, data_fields=["conv", "delta", "pending"],
                                 meta_fields=[])


def state_shapes(config: LinearAttentionConfig, slots: int) -> LinearState:
    """The pools' shapes (tuples) for `slots` slots."""
    c = config
    return LinearState(conv=(slots, c.conv_width - 1, c.num_key_heads, c.channels_per_key_head),
                       delta=(slots, c.num_value_heads, c.key_head_dim, c.value_head_dim))


def empty_state(config: LinearAttentionConfig, slots: int) -> LinearState:
    """Zeroed pools of `slots` slots."""
    return jax.tree.map(lambda shape: jnp.zeros(shape, jnp.float32),
                        state_shapes(config, slots), is_leaf=lambda x: isinstance(x, tuple))


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: LinearAttentionConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        heads = c.num_value_heads
        self.in_proj_qkv = nnx.Param(init_weight(
            rngs, (c.hidden_size, c.num_key_heads, c.channels_per_key_head), dtype))
        self.in_proj_z = nnx.Param(init_weight(rngs, (c.hidden_size, heads, c.value_head_dim),
                                               dtype))
        self.in_proj_ba = nnx.Param(init_weight(rngs, (c.hidden_size, 2, heads), dtype))
        self.conv_weight = nnx.Param(init_weight(
            rngs, (c.num_key_heads, c.channels_per_key_head, c.conv_width), dtype))
        self.A_log = nnx.Param(jnp.zeros((heads,), jnp.float32))
        self.dt_bias = nnx.Param(jnp.ones((heads,), dtype))
        self.gated_norm = nnx.Param(jnp.ones((c.value_head_dim,), dtype))  # plain weight
        self.out_proj = nnx.Param(init_weight(rngs, (heads, c.value_head_dim, c.hidden_size),
                                              dtype))

    def __call__(self, x, cos, sin, state: LinearState, metadata, kernels: Kernels, lora=None,
                 **_) -> tuple[jax.Array, LinearState]:
        """x [T, hidden] (a ragged step's rows, as `metadata` describes them; sequence s reads
        and writes slot `metadata.state_slots[s]`) -> (float32 [T, hidden], the pools updated).
        Attention's signature (transformer.DecoderLayer calls either): no RoPE (`cos`, `sin`
        unused), no LoRA (start-up refuses it for these models)."""
        c, m = self.config, metadata
        rows, dk = x.shape[0], c.key_head_dim
        conv_weight = self.conv_weight[...]
        # The projection rounded to the model dtype, as transformers' convolution takes it.
        qkv = project(x, self.in_proj_qkv[...], kernels).astype(conv_weight.dtype)
        slots, verified = state.conv.shape[0], m.verified_rows
        writes = None if verified is None else verified.writes
        mixed, conv = causal_conv1d(
            qkv.reshape(rows, -1), conv_weight.reshape(-1, c.conv_width), None,
            state.conv.reshape(slots, c.conv_width - 1, -1), m.state_slots, m.kv_lens,
            m.cu_q_lens, m.num_seqs, activation="silu", writes=writes)
        mixed = mixed.reshape(rows, c.num_key_heads, c.channels_per_key_head)
        q, k = mixed[..., :dk], mixed[..., dk:2 * dk]
        v = mixed[..., 2 * dk:].reshape(rows, c.num_value_heads, c.value_head_dim)
        ba = linear(x, self.in_proj_ba[...], kernels)  # [T, 2, Hv]
        beta = jax.nn.sigmoid(ba[:, 0])
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            ba[:, 1] + self.dt_bias[...].astype(jnp.float32))
        out, delta = kernels.gated_delta_rule(q, k, v, g, beta, state.delta, m.state_slots,
                                              m.kv_lens, m.cu_q_lens, m.num_seqs, writes)
        z = project(x, self.in_proj_z[...], kernels)
        gated = gated_rms_norm(out, z, self.gated_norm[...], c.rms_norm_eps)
        out_proj = self.out_proj[...]
        y = project(gated.reshape(rows, c.value_dim).astype(matmul_input_dtype(out_proj)),
                    out_proj, kernels)
        pending = None if verified is None else PendingRows(
            *(x[verified.rows] for x in (qkv, k, v, g, beta)))
        return y, LinearState(conv.reshape(state.conv.shape), delta, pending)

    def input_matrix(self):
        """The first matrix the layer's input meets (its dtype is the input's)."""
        return self.in_proj_qkv[...]


def commit_accepted(state: LinearState, kept_lens: jax.Array, slots: jax.Array,
                    verified: jax.Array) -> LinearState:
    """The pools after a speculative step (`state.pending` set, dropped here): each verified
    sequence's slot (bool[S] `verified`; `slots` i32[S]) advanced by its row's first
    `kept_lens[s]` tokens (the last token and its accepted drafts), from the state the step left
    there: the rule's updates (reference.delta_rule_update, float32), and the window's last
    W - 1 inputs (`commit_rows`)."""
    p = state.pending
    seqs, width = p.k.shape[:2]
    flat = lambda x: x.reshape(seqs * width, *x.shape[2:])
    _, k, v, g, beta = (x.reshape(seqs, width, *x.shape[1:]) for x in prepared_inputs(
        flat(p.k), flat(p.k), flat(p.v), flat(p.g), flat(p.beta)))
    update = lambda rule, i: delta_rule_update(rule, k[:, i], v[:, i], g[:, i], beta[:, i])
    return LinearState(*commit_rows(state.conv, p.raw, state.delta, update, kept_lens, slots,
                                    verified))


def commit_rows(conv_pool, raw, pool, update, kept_lens, slots, verified):
    """(conv_pool, pool) with each verified sequence's slot advanced by its row's first
    `kept_lens[s]` tokens: `update(states [S, ...] float32, i)`, the states after row token i
    (the others' rows ignored), from the slot's state; and its window, the last W - 1 of the
    slot's window and `raw` [S, W, ...] (the rows' convolution inputs). A linear layer's
    speculative step (`commit_accepted`, mamba2.py's)."""
    seqs, width = raw.shape[:2]
    targets = jnp.where(verified, slots, pool.shape[0])  # the others dropped

    def token(i, states):
        kept = (i < kept_lens).reshape(-1, *(1,) * (states.ndim - 1))
        return jnp.where(kept, update(states, i), states)

    states = jax.lax.fori_loop(0, width, token, pool[slots].astype(jnp.float32))
    # The window with its channels flat, as the layer's convolution views it: on TPU a view of
    # [slots, W - 1, Hk, C] beside the [slots, W - 1, Hk * C] one relaid the pool out (a copy).
    conv = conv_pool.reshape(*conv_pool.shape[:2], -1)
    inputs = jnp.concatenate([conv[slots], raw.reshape(seqs, width, -1).astype(conv.dtype)],
                             axis=1)
    last = kept_lens[:, None] + jnp.arange(conv.shape[1])  # the W - 1 inputs before the next row
    window = jnp.take_along_axis(inputs, last[:, :, None], axis=1)
    # Both read whole before the pools are written (as reference.causal_conv1d's windows).
    window, states = jax.lax.optimization_barrier((window, states))
    conv = conv.at[targets].set(window, mode="drop").reshape(conv_pool.shape)
    return conv, pool.at[targets].set(states.astype(pool.dtype), mode="drop")


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """transformers' `Qwen3NextRMSNormGated`: x normalized over its last axis in float32, rounded
    to x's dtype before the weight multiplies it, times silu(gate) in float32; in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scaled = weight * normed.astype(x.dtype)
    return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def from_grouped_projections(qkvz: np.ndarray, ba: np.ndarray,
                             config: LinearAttentionConfig) -> dict[str, np.ndarray]:
    """Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` (PyTorch's [out, in]), grouped by key head
    (per key head: its q, its k, then the v and z of its value heads; its b, then its a) ->
    Qwen3.5's `in_proj_qkv` ([q | k | v] rows), `in_proj_z`, `in_proj_b`, `in_proj_a` (PyTorch's
    [out, in] too)."""
    c = config
    per_key = c.num_value_heads // c.num_key_heads
    grouped = qkvz.reshape(c.num_key_heads, -1, qkvz.shape[-1])
    sizes = np.cumsum([c.key_head_dim, c.key_head_dim, per_key * c.value_head_dim])
    q, k, v, z = np.split(grouped, sizes, axis=1)
    b, a = np.split(ba.reshape(c.num_key_heads, 2 * per_key, -1), [per_key], axis=1)
    rows = lambda x: x.reshape(-1, x.shape[-1])
    return {"in_proj_qkv": np.concatenate([rows(q), rows(k), rows(v)]),
            "in_proj_z": rows(z), "in_proj_b": rows(b), "in_proj_a": rows(a)}


def by_key_head(rows: np.ndarray, config: LinearAttentionConfig) -> np.ndarray:
    """[q | k | v] rows [conv_dim, ...] (Qwen3.5's `in_proj_qkv`, the convolution's channels) ->
    [Hk, 2 Dk + (Hv / Hk) Dv, ...]: each key head's q, k and its value heads' v together."""
    c = config
    q, k, v = np.split(rows, [c.key_dim, 2 * c.key_dim])
    heads = lambda x: x.reshape(c.num_key_heads, -1, *rows.shape[1:])
    return np.concatenate([heads(q), heads(k), heads(v)], axis=1)
