"""The Mamba-2 mixer, Nemotron-H's linear layer (issue 76; config: model/config/mamba2_config.py),
transformers' `NemotronHMamba2Mixer`:

    z, xBC, dt = x W_in                      z [H, P]; xBC: x [H, P], B and C [G, N]; dt [H]
    xBC = silu(conv1d(xBC) + conv_bias)      causal, depthwise, W wide
    dt = clamp(softplus(dt + dt_bias), time_step_limit),  A = -exp(A_log)
    y = ssm(x, dt, A, B, C) + D x            (Kernels.mamba2_ssm: pallas_kernels/mamba2/)
    out = (grouped_rms_norm(y * silu(z)) * w) W_out    the norm over each group's channels

Its state, like Gated DeltaNet's (model/linear_attention.py), is a slot per request of two
float32 pools (`Mamba2State`): the convolution's last W - 1 inputs and each head's [N, P] state,
after the KV pool's arrays in a step's caches (ModelConfig.cache_slot); sequence s reads and
writes slot `metadata.state_slots[s]`, from zeros at a prompt's first token. Its call is
GatedDeltaNet's, so transformer.DecoderLayer runs either. In a speculative step it keeps its
verified rows' inputs (`PendingScan`) and commits their accepted tokens as Gated DeltaNet does
(linear_attention.commit_rows).

Layout: everything by group, so that tensor parallelism splits the layer by group (its heads
with it: head h is group h // (H / G)'s) as attention is split by KV head, with no exchange but
out_proj's sum (model/sharding.py). `in_proj_xbc` [hidden, G, (H / G) P + 2 N] holds per group
its heads' x, its B and its C (the convolution's channels in that order, `conv_weight`
[G, same, W], `conv_bias` [G, same]); `in_proj_z` [hidden, H, P]; `in_proj_dt` [hidden, H];
`group_norm` [G, (H / G) P]; `out_proj` [H, P, hidden]. The checkpoint's `in_proj` keeps
z | x | B | C | dt whole: weights/linear_attention_layout.py regroups it once at load (`by_group`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.model.config.mamba2_config import Mamba2Config
from xlaserve.model.layers import Kernels, init_weight, linear, matmul_input_dtype, project
from xlaserve.model.linear_attention import commit_rows
from xlaserve.pallas_kernels.linear_attention.reference import causal_conv1d, delta_rule_update
from xlaserve.pallas_kernels.mamba2.reference import by_head


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PendingScan:
    """A layer's inputs of a speculative step's VerifiedRows.rows ([S, W, ...]): the
    convolution's `raw` inputs, and the scan's x, dt (softplus'd, clamped) and B."""

    raw: jax.Array
    x: jax.Array
    dt: jax.Array
    B: jax.Array


@dataclasses.dataclass
class Mamba2State:
    """One layer's state pools, float32: `conv` [slots, W - 1, G, channels] (the convolution's
    inputs before a request's next row, oldest first, each group's channels) and `ssm`
    [slots, H, N, P] (the heads' states, the gated delta rule's layout: B and C its k and q). A
    request owns one slot of both, in every Mamba-2 layer. `pending`: in a speculative step,
    until `commit_accepted`, the verified rows' inputs and A (else None)."""

    conv: jax.Array
    ssm: jax.Array
    pending: tuple[PendingScan, jax.Array] | None = None

    def commit_accepted(self, kept_lens, slots, verified) -> "Mamba2State":
        """linear_attention.commit_accepted's, for the scan (the rule's update without the
        delta: S <- exp(dt A) S + B (dt x)^T)."""
        p, A = self.pending
        x, dt, B = (a.astype(jnp.float32) for a in (p.x, p.dt, by_head(p.B, p.x.shape[2])))
        update = lambda ssm, i: delta_rule_update(ssm, B[:, i], dt[:, i, :, None] * x[:, i],
                                                  dt[:, i] * A, jnp.ones_like(dt[:, i]), "ssd")
        return Mamba2State(*commit_rows(self.conv, p.raw, self.ssm, update, kept_lens, slots,
                                        verified))


jax.tree_util.register_dataclass(Mamba2State, data_fields=["conv", "ssm", "pending"],
                                 meta_fields=[])


def state_shapes(config: Mamba2Config, slots: int) -> Mamba2State:
    """The pools' shapes (tuples) for `slots` slots."""
    c = config
    return Mamba2State(conv=(slots, c.conv_width - 1, c.num_groups, c.channels_per_group),
                       ssm=(slots, c.num_heads, c.state_size, c.head_dim))


class Mamba2Mixer(nnx.Module):
    def __init__(self, config: Mamba2Config, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        groups, heads = c.num_groups, c.num_heads
        self.in_proj_xbc = nnx.Param(init_weight(
            rngs, (c.hidden_size, groups, c.channels_per_group), dtype))
        self.in_proj_z = nnx.Param(init_weight(rngs, (c.hidden_size, heads, c.head_dim), dtype))
        self.in_proj_dt = nnx.Param(init_weight(rngs, (c.hidden_size, heads), dtype))
        self.conv_weight = nnx.Param(init_weight(
            rngs, (groups, c.channels_per_group, c.conv_width), dtype))
        if c.conv_bias:
            self.conv_bias = nnx.Param(jnp.zeros((groups, c.channels_per_group), dtype))
        self.A_log = nnx.Param(jnp.zeros((heads,), jnp.float32))
        self.dt_bias = nnx.Param(jnp.ones((heads,), dtype))
        self.D = nnx.Param(jnp.ones((heads,), dtype))
        self.group_norm = nnx.Param(jnp.ones((groups, c.heads_per_group * c.head_dim), dtype))
        self.out_proj = nnx.Param(init_weight(rngs, (heads, c.head_dim, c.hidden_size), dtype))

    def __call__(self, x, cos, sin, state: Mamba2State, metadata, kernels: Kernels, lora=None,
                 **_) -> tuple[jax.Array, Mamba2State]:
        """x [T, hidden] (a ragged step's rows, as `metadata` describes them; sequence s reads
        and writes slot `metadata.state_slots[s]`) -> (float32 [T, hidden], the pools updated).
        GatedDeltaNet's signature: no RoPE (`cos`, `sin` unused), no LoRA (start-up refuses it
        for these models)."""
        c, m = self.config, metadata
        rows, width, slots = x.shape[0], c.conv_width, state.conv.shape[0]
        conv_weight = self.conv_weight[...]
        # The projection rounded to the model dtype, as transformers' convolution takes it.
        xbc = project(x, self.in_proj_xbc[...], kernels).astype(conv_weight.dtype)
        bias = self.conv_bias[...].reshape(-1) if c.conv_bias else None
        verified = m.verified_rows  # a speculative step's (linear_attention.VerifiedRows)
        writes = None if verified is None else verified.writes
        mixed, conv = causal_conv1d(
            xbc.reshape(rows, -1), conv_weight.reshape(-1, width), bias,
            state.conv.reshape(slots, width - 1, -1), m.state_slots, m.kv_lens, m.cu_q_lens,
            m.num_seqs, activation="silu", writes=writes)
        mixed = mixed.reshape(rows, c.num_groups, c.channels_per_group)
        inner = c.heads_per_group * c.head_dim
        xs = mixed[..., :inner].reshape(rows, c.num_heads, c.head_dim)
        B, C = mixed[..., inner:inner + c.state_size], mixed[..., inner + c.state_size:]
        low, high = c.time_step_limit
        dt = jnp.clip(jax.nn.softplus(linear(x, self.in_proj_dt[...], kernels)
                                      + self.dt_bias[...].astype(jnp.float32)), low, high)
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        y, ssm = kernels.mamba2_ssm(xs, dt, A, B, C, self.D[...], state.ssm, m.state_slots,
                                    m.kv_lens, m.cu_q_lens, m.num_seqs, writes)
        z = project(x, self.in_proj_z[...], kernels)
        gated = gated_group_norm(y.reshape(rows, c.num_groups, inner),
                                 z.reshape(rows, c.num_groups, inner), self.group_norm[...],
                                 c.rms_norm_eps)
        out_proj = self.out_proj[...]
        out = project(gated.reshape(rows, c.inner_size).astype(matmul_input_dtype(out_proj)),
                      out_proj, kernels)
        pending = None if verified is None else (
            PendingScan(*(a[verified.rows] for a in (xbc, xs, dt, B))), A)
        return out, Mamba2State(conv.reshape(state.conv.shape), ssm, pending)

    def input_matrix(self):
        """The first matrix the layer's input meets (its dtype is the input's)."""
        return self.in_proj_xbc[...]


def gated_group_norm(y: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """transformers' `NemotronHRMSNormGated`: y * silu(gate) in float32 (the gate first), then
    normalized over each group's channels (the last axis), times the weight; float32."""
    gated = y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    normed = gated * jax.lax.rsqrt(jnp.mean(gated * gated, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * normed


def by_group(in_proj: np.ndarray, config: Mamba2Config) -> dict[str, np.ndarray]:
    """The checkpoint's `in_proj` [z | x | B | C | dt rows, hidden] (PyTorch's [out, in]) ->
    our `in_proj_xbc` [hidden, G, (H / G) P + 2 N], `in_proj_z` [hidden, H, P] and
    `in_proj_dt` [hidden, H]."""
    c = config
    z, x, b, cc, dt = np.split(in_proj, np.cumsum(
        [c.inner_size, c.inner_size, c.num_groups * c.state_size,
         c.num_groups * c.state_size]))
    xbc = conv_channels_by_group(np.concatenate([x, b, cc]), c)  # [G, channels, hidden]
    return {"in_proj_xbc": np.ascontiguousarray(np.moveaxis(xbc, -1, 0)),
            "in_proj_z": np.ascontiguousarray(z.T).reshape(-1, c.num_heads, c.head_dim),
            "in_proj_dt": np.ascontiguousarray(dt.T)}


def conv_channels_by_group(rows: np.ndarray, config: Mamba2Config) -> np.ndarray:
    """[x | B | C rows, ...] (the checkpoint's convolution channels) -> [G, (H / G) P + 2 N,
    ...]: each group's heads' x, its B and its C together."""
    c = config
    x, b, cc = np.split(rows, [c.inner_size, c.inner_size + c.num_groups * c.state_size])
    groups = lambda a: a.reshape(c.num_groups, -1, *rows.shape[1:])
    return np.concatenate([groups(x), groups(b), groups(cc)], axis=1)
