"""What a decoder layer holds besides attention (transformer.DecoderLayer builds it from here):
its linear mixer where the layer keeps a state (Gated DeltaNet, model/linear_attention.py; or
Nemotron-H's Mamba-2, model/mamba2.py), and its feed-forward with the norm in front of it: the
experts (model/moe.py), the gated MLP (layers.MLP), Nemotron-H's ReLU^2 MLP, or, for a Nemotron-H
mixer block with no MLP block after it (model/config/mamba2_config.py), none: `NoMLP`, which adds
nothing, behind a norm without a weight."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.layers import MLP, Kernels, ReluSquaredMLP, RMSNorm
from xlaserve.model.linear_attention import GatedDeltaNet
from xlaserve.model.mamba2 import Mamba2Mixer
from xlaserve.model.moe import MoE


def state_mixer(config, dtype, rngs: nnx.Rngs):
    """A linear layer's mixer (ModelConfig `config`): Mamba-2's where the config has its shapes,
    else Gated DeltaNet's."""
    if config.mamba2 is not None:
        return Mamba2Mixer(config.mamba2, dtype, rngs)
    return GatedDeltaNet(config.linear_attention, dtype, rngs)


def feed_forward(config, layer_index: int, dtype, rngs: nnx.Rngs):
    """(post-attention norm, MLP) of layer `layer_index` (ModelConfig `config`)."""
    c = config
    if c.nemotron_blocks and c.nemotron_blocks[layer_index][1] < 0:
        return NoNorm(c.hidden_size, c.rms_norm_eps), NoMLP()
    norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
    if c.moe_layers[layer_index]:
        return norm, MoE(c, dtype, rngs)
    width = c.layer(layer_index).intermediate_size
    if c.activation == "relu2":
        return norm, ReluSquaredMLP(c.hidden_size, width, dtype, rngs)
    return norm, MLP(c.hidden_size, width, dtype, rngs, c.activation)


class NoMLP(nnx.Module):
    """A layer without a feed-forward: it adds zeros (XLA drops the norm in front of it)."""

    def input_dtype(self) -> jnp.dtype:
        return jnp.dtype(jnp.float32)

    def __call__(self, x: jax.Array, kernels: Kernels, lora=None) -> jax.Array:
        return jnp.zeros(x.shape, jnp.float32)


class NoNorm(nnx.Module):
    """The norm in front of `NoMLP`: RMSNorm's interface, a weight of ones and no parameter."""

    def __init__(self, dim: int, eps: float):
        self.dim, self.eps = dim, eps

    def factor(self) -> jax.Array:
        return jnp.ones((self.dim,), jnp.float32)
