"""Gemma 4's vision tower and embedder (gemma-4-31b/26b-a4b/e2b/e4b-it), ported from transformers'
Gemma4VisionModel and Gemma4MultimodalEmbedder, and `Gemma4VisionLM`, the decoder beside them.

    x = (2 patches - 1) @ patch_embed + columns[x] + rows[y]   (patches in [0, 1]; no bias; the
                                                                 [2, P, W] position table)
    per layer:  x = x + post_attention_norm(o(attention(q, k, v)))    q = rope2d(q_norm(q(h))),
                                                                      k = rope2d(k_norm(k(h))),
                                                                      v = rms(v(h)), h = input_norm(x)
                x = x + post_mlp_norm(down(gelu_tanh(gate(h)) * up(h)))     h = pre_mlp_norm(x)
    -> each pooling x pooling square of patches averaged (by their positions), times sqrt(W),
       (x - std_bias) * std_scale with `standardize`, a weightless RMS norm, @ projection:
       [tokens_per_image, decoder hidden], the image's tokens first (the rest: padding)

One image a run, its patches padded to the run's bucket (runtime/executor/towers/gemma4_encoder.py):
the attention keeps to the first `count` rows (Kernels.bidirectional_attention over one
sequence), the padding rows are dropped before the pooling. The 2-D RoPE
(Gemma4VisionRotaryEmbedding with apply_multidimensional_rope): a head's first half rotated by
the patch's column, its second half by its row, each half-split as transformers' rotate_half,
at theta ** (-4i / head_dim). With `clipped` (use_clipped_linears: e2b, e4b) each projection's
input and output are clamped to the checkpoint's bounds, so q, k and v (and gate and up), whose
inputs are clamped differently, are three (two) matmuls. Weights keep the decoder's names and
layouts (qkv [W, heads, 3, D], o_proj [heads, D, W], gate_up [W, 2, I], down [I, W]), so their
partition specs (model/sharding.py) split heads and the MLP over tensor-parallel devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.config.gemma4_vision_config import Gemma4VisionConfig
from xlaserve.model.layers import (Kernels, RMSNorm, apply_rope, init_weight, linear,
                                   matmul_input_dtype, project, rms_norm)
from xlaserve.model.vision.siglip_vision import Gemma3VisionLM

_UNBOUNDED = (-jnp.inf, jnp.inf, -jnp.inf, jnp.inf)


class ClipBounds(nnx.Module):
    """Gemma4ClippableLinear's bounds of `count` projections: [count, 4] as (input min, input
    max, output min, output max), unbounded until loaded."""

    def __init__(self, count: int, dtype):
        self.bounds = nnx.Param(jnp.tile(jnp.asarray(_UNBOUNDED, dtype), (count, 1)))

    def __getitem__(self, index: int) -> jax.Array:
        return self.bounds[...][index].astype(jnp.float32)


def _projected(x, weight, kernels: Kernels, bounds=None) -> jax.Array:
    """float32 x @ weight, x clamped to bounds[0:2] and the product to bounds[2:4] (None: not)."""
    if bounds is not None:
        x = jnp.clip(x.astype(jnp.float32), bounds[0], bounds[1])
    y = project(x.astype(matmul_input_dtype(weight)), weight, kernels).astype(jnp.float32)
    return y if bounds is None else jnp.clip(y, bounds[2], bounds[3])


def _rope2d(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, H, D] float32 with its first half rotated by the columns' (cos, sin) [2, B, D/4],
    its second by the rows'."""
    half = x.shape[-1] // 2
    return jnp.concatenate([apply_rope(x[..., :half], cos[0], sin[0]),
                            apply_rope(x[..., half:], cos[1], sin[1])], axis=-1)


class Gemma4VisionBlock(nnx.Module):
    def __init__(self, config: Gemma4VisionConfig, dtype, rngs: nnx.Rngs):
        c, width, eps = config, config.hidden_size, config.norm_eps
        self.config = c
        self.input_norm = RMSNorm(width, eps, dtype)
        self.post_attention_norm = RMSNorm(width, eps, dtype)
        self.pre_mlp_norm = RMSNorm(width, eps, dtype)
        self.post_mlp_norm = RMSNorm(width, eps, dtype)
        self.qkv = nnx.Param(init_weight(rngs, (width, c.num_heads, 3, c.head_dim), dtype))
        self.q_norm = RMSNorm(c.head_dim, eps, dtype)
        self.k_norm = RMSNorm(c.head_dim, eps, dtype)
        self.o_proj = nnx.Param(init_weight(rngs, (c.num_heads, c.head_dim, width), dtype))
        self.gate_up = nnx.Param(init_weight(rngs, (width, 2, c.intermediate_size), dtype))
        self.down = nnx.Param(init_weight(rngs, (c.intermediate_size, width), dtype))
        if c.clipped:
            self.qkv_clip, self.o_clip = ClipBounds(3, dtype), ClipBounds(1, dtype)
            self.gate_up_clip, self.down_clip = ClipBounds(2, dtype), ClipBounds(1, dtype)

    def __call__(self, x, cos, sin, cu_seqs, num_seqs, kernels: Kernels) -> jax.Array:
        c = self.config
        clip = self.qkv_clip if c.clipped else None
        h = self.input_norm(x)
        if clip is None:
            q, k, v = (part for part in jnp.moveaxis(
                _projected(h, self.qkv[...], kernels), 2, 0))
        else:  # each its own input clamp: three matmuls
            q, k, v = (_projected(h, self.qkv[...][:, :, i], kernels, clip[i]) for i in range(3))
        dtype = matmul_input_dtype(self.o_proj[...])
        q = _rope2d(self.q_norm(q), cos, sin).astype(dtype)
        k = _rope2d(self.k_norm(k), cos, sin).astype(dtype)
        v = rms_norm(v, jnp.float32(1.0), c.norm_eps).astype(dtype)
        out, _ = kernels.bidirectional_attention(q, k, v, cu_seqs, num_seqs, sm_scale=1.0)
        out = _projected(out.reshape(x.shape[0], -1).astype(dtype), self.o_proj[...], kernels,
                         self.o_clip[0] if c.clipped else None)
        x = x + self.post_attention_norm(out)
        h = self.pre_mlp_norm(x)
        clip = self.gate_up_clip if c.clipped else None
        if clip is None:
            gate_up = _projected(h, self.gate_up[...], kernels)
            gate, up = gate_up[:, 0], gate_up[:, 1]
        else:
            gate, up = (_projected(h, self.gate_up[...][:, i], kernels, clip[i])
                        for i in range(2))
        hidden = jax.nn.gelu(gate, approximate=True) * up
        down = _projected(hidden, self.down[...], kernels, self.down_clip[0] if c.clipped
                          else None)
        return x + self.post_mlp_norm(down)


class Standardize(nnx.Module):
    """(x - bias) * scale in float32 (Gemma4VisionModel's std_bias, std_scale)."""

    def __init__(self, width: int, dtype):
        self.bias = nnx.Param(jnp.zeros((width,), dtype))
        self.scale = nnx.Param(jnp.ones((width,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (x - self.bias[...].astype(jnp.float32)) * self.scale[...].astype(jnp.float32)


class Gemma4VisionTower(nnx.Module):
    def __init__(self, config: Gemma4VisionConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.patch_embed = nnx.Param(init_weight(rngs, (c.patch_dim, c.hidden_size), dtype))
        self.pos_embed = nnx.Param(init_weight(
            rngs, (2, c.position_embedding_size, c.hidden_size), dtype))
        self.blocks = nnx.List([Gemma4VisionBlock(c, dtype, rngs) for _ in range(c.depth)])
        if c.standardize:
            self.standardize = Standardize(c.hidden_size, dtype)
        self.projection = nnx.Param(init_weight(rngs, (c.hidden_size, c.out_hidden_size), dtype))

    def __call__(self, patches: jax.Array, positions: jax.Array, count: jax.Array,
                 kernels: Kernels) -> jax.Array:
        """float32 [tokens_per_image, out_hidden_size]: the decoder rows of one image whose
        first `count` [1] of `patches` [B, patch_dim] (the processor's, in [0, 1]) are its own,
        at `positions` [B, 2] (column, row); its count / pooling^2 tokens first."""
        c = self.config
        weight = self.patch_embed[...]
        valid = (jnp.arange(patches.shape[0]) < count[0])[:, None]
        scaled = (2.0 * (patches.astype(jnp.float32) - 0.5)).astype(weight.dtype)
        x = jnp.dot(scaled, weight, preferred_element_type=jnp.float32)
        where = jnp.maximum(positions, 0)
        table = self.pos_embed[...]
        x = x + jnp.where(valid, table[0][where[:, 0]] + table[1][where[:, 1]], 0).astype(
            jnp.float32)
        cos, sin = self._rope(where)
        cu_seqs = jnp.concatenate([jnp.zeros((1,), jnp.int32), count.astype(jnp.int32)])
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqs, jnp.ones((1,), jnp.int32), kernels)
        pooled = self._pool(jnp.where(valid, x.astype(weight.dtype), 0), where, valid[:, 0])
        if c.standardize:
            pooled = self.standardize(pooled)
        normed = rms_norm(pooled.astype(weight.dtype), jnp.float32(1.0), c.norm_eps)
        projection = self.projection[...]
        return linear(normed.astype(matmul_input_dtype(projection)), projection, kernels)

    def _rope(self, where: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(cos, sin) float32 [2, B, head_dim / 4]: the columns' angles, then the rows'."""
        half = self.config.head_dim // 2
        inv_freq = self.config.rope_theta ** (-jnp.arange(0, half, 2, dtype=jnp.float32) / half)
        angles = where.T.astype(jnp.float32)[..., None] * inv_freq
        return jnp.cos(angles), jnp.sin(angles)

    def _pool(self, x: jax.Array, where: jax.Array, valid: jax.Array) -> jax.Array:
        """float32 [tokens_per_image, W]: the mean of each pooling x pooling square of the
        image's patches (transformers' _avg_pool_by_positions: its tokens in row-major order),
        rounded to the model dtype as transformers rounds it, times sqrt(W)."""
        c = self.config
        k = c.pooling
        columns = jnp.max(jnp.where(valid, where[:, 0], 0)) + 1
        token = where[:, 0] // k + (columns // k) * (where[:, 1] // k)
        token = jnp.where(valid, token, c.tokens_per_image)  # dropped
        pooled = jax.ops.segment_sum(x.astype(jnp.float32), token,
                                     num_segments=c.tokens_per_image) / k ** 2
        return pooled.astype(x.dtype).astype(jnp.float32) * c.hidden_size ** 0.5


class Gemma4VisionLM(Gemma3VisionLM):
    """Gemma4ForConditionalGeneration: the Gemma 4 decoder (CausalLM: its per-layer embeddings
    read the pad token's for image rows, as transformers does) and its vision tower, run per
    image by the engine (runtime/executor/towers/gemma4_encoder.py); the step takes the tower's rows
    in place of the image tokens' embeddings, unscaled, and where the config says
    (`whole_images`) the image tokens see their whole image in the sliding layers
    (Gemma3VisionLM.hidden_states)."""

    tower = Gemma4VisionTower
