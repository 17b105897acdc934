"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (issue 76): three of every
four layers of those models, the fourth a gated full-attention layer.

    qkv = conv1d(x W_qkv) (causal, depthwise, W = 4 wide, then SiLU), split into q, k [Hk, Dk]
          and v [Hv, Dv]
    beta = sigmoid(x W_b),  g = -exp(A_log) softplus(x W_a + dt_bias)       per value head
    o = gated_delta_rule(q, k, v, g, beta)        (pallas_kernels/linear_attention/reference.py)
    y = (RMSNorm(o) * silu(x W_z)) W_out           the norm per value head, gated

Its state is not a KV cache: per request, a slot of two pools (`LinearState`): the convolution's
last W - 1 inputs and each value head's [Dk, Dv] matrix. A step's caches hold each linear layer's
pools after the KV pool's arrays (ModelConfig.cache_slot); sequence s reads and writes the slot
of its request (`AttentionMetadata.state_slots`), from zeros at a prompt's first token. Under
tensor parallelism the layer is whole on every device (its weights and state replicated: correct,
not yet split by head). The weights are held in one layout,
Qwen3.5's (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, as [in, out] matrices);
Qwen3-Next's checkpoints group q, k, v and z by key head (`in_proj_qkvz`, `in_proj_ba`), which
`from_grouped_projections` reorders once at load.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.model.config.linear_attention_config import LinearAttentionConfig
from xlaserve.model.layers import Kernels, init_weight, linear, matmul_input_dtype, project
from xlaserve.pallas_kernels.linear_attention.reference import causal_conv1d, gated_delta_rule


@dataclasses.dataclass
class LinearState:
    """One layer's state pools: `conv` [slots, conv_dim, W - 1] (the inputs before a request's
    next row, oldest first) and `delta` float32 [slots, Hv, Dk, Dv] (the delta rule's matrices).
    A request owns one slot of both, in every linear layer."""

    conv: jax.Array
    delta: jax.Array


jax.tree_util.register_dataclass(LinearState, data_fields=["conv", "delta"], meta_fields=[])


def empty_state(config: LinearAttentionConfig, slots: int, dtype) -> LinearState:
    """Zeroed pools of `slots` slots; the convolution's window in the model dtype."""
    return LinearState(
        conv=jnp.zeros((slots, config.conv_dim, config.conv_width - 1), dtype),
        delta=jnp.zeros((slots, config.num_value_heads, config.key_head_dim,
                         config.value_head_dim), jnp.float32))


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: LinearAttentionConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.in_proj_qkv = nnx.Param(init_weight(rngs, (c.hidden_size, c.conv_dim), dtype))
        self.in_proj_z = nnx.Param(init_weight(rngs, (c.hidden_size, c.value_dim), dtype))
        self.in_proj_b = nnx.Param(init_weight(rngs, (c.hidden_size, c.num_value_heads), dtype))
        self.in_proj_a = nnx.Param(init_weight(rngs, (c.hidden_size, c.num_value_heads), dtype))
        self.conv_weight = nnx.Param(init_weight(rngs, (c.conv_dim, c.conv_width), dtype))
        self.A_log = nnx.Param(jnp.zeros((c.num_value_heads,), jnp.float32))
        self.dt_bias = nnx.Param(jnp.ones((c.num_value_heads,), dtype))
        self.gated_norm = nnx.Param(jnp.ones((c.value_head_dim,), dtype))  # plain weight
        self.out_proj = nnx.Param(init_weight(rngs, (c.value_dim, c.hidden_size), dtype))

    def __call__(self, x, cos, sin, state: LinearState, metadata, kernels: Kernels, lora=None,
                 **_) -> tuple[jax.Array, LinearState]:
        """x [T, hidden] (a ragged step's rows, as `metadata` describes them; sequence s reads
        and writes slot `metadata.state_slots[s]`) -> (float32 [T, hidden], the pools updated).
        Attention's signature (transformer.DecoderLayer calls either): no RoPE (`cos`, `sin`
        unused), no LoRA (model/lora.check_model refuses these models)."""
        c, m = self.config, metadata
        rows = x.shape[0]
        qkv = project(x, self.in_proj_qkv[...], kernels).astype(self.conv_weight.get_value().dtype)
        mixed, conv = causal_conv1d(qkv, self.conv_weight[...], None, state.conv, m.state_slots,
                                    m.kv_lens, m.cu_q_lens, m.num_seqs, activation="silu")
        q = mixed[:, :c.key_dim].reshape(rows, c.num_key_heads, c.key_head_dim)
        k = mixed[:, c.key_dim:2 * c.key_dim].reshape(rows, c.num_key_heads, c.key_head_dim)
        v = mixed[:, 2 * c.key_dim:].reshape(rows, c.num_value_heads, c.value_head_dim)
        beta = jax.nn.sigmoid(linear(x, self.in_proj_b[...], kernels))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            linear(x, self.in_proj_a[...], kernels) + self.dt_bias[...].astype(jnp.float32))
        out, delta = gated_delta_rule(q, k, v, g, beta, state.delta, m.state_slots, m.kv_lens,
                                      m.cu_q_lens, m.num_seqs)
        z = project(x, self.in_proj_z[...], kernels).reshape(rows, c.num_value_heads,
                                                              c.value_head_dim)
        gated = gated_rms_norm(out, z, self.gated_norm[...], c.rms_norm_eps)
        y = project(gated.reshape(rows, c.value_dim).astype(matmul_input_dtype(self.out_proj[...])),
                    self.out_proj[...], kernels)
        return y, LinearState(conv=conv, delta=delta)

    def input_matrix(self):
        """The first matrix the layer's input meets (its dtype is the input's)."""
        return self.in_proj_qkv[...]


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
    Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` as [in, out] matrices."""
    c = config
    per_key = c.num_value_heads // c.num_key_heads
    grouped = qkvz.reshape(c.num_key_heads, -1, qkvz.shape[-1])
    sizes = np.cumsum([c.key_head_dim, c.key_head_dim, per_key * c.value_head_dim])
    q, k, v, z = np.split(grouped, sizes, axis=1)
    b, a = np.split(ba.reshape(c.num_key_heads, 2 * per_key, -1), [per_key], axis=1)
    rows = lambda x: x.reshape(-1, x.shape[-1]).T
    return {"in_proj_qkv": np.concatenate([rows(q), rows(k), rows(v)], axis=1),
            "in_proj_z": rows(z), "in_proj_b": rows(b), "in_proj_a": rows(a)}
