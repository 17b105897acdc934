"""Llama 4's vision encoder and multi-modal projector (Llama-4-Scout-17B-16E, Maverick), ported
from transformers' Llama4VisionModel and Llama4MultiModalProjector, and `Llama4VisionLM`, the
decoder beside them.

    per tile [C, S, S]:
    x = patches @ patch_embed                     (nn.Unfold + a linear without bias: a matmul)
    x = [x; class_embedding] + positions          (the class row last; one position per row)
    x = pre_norm(x)
    per layer:  x = x + o(attention(rope(qkv(norm1(x)))))     (over its tile, 2D RoPE)
                x = x + fc2(gelu(fc1(norm2(x))))
    x = post_norm(x), the class row dropped
    -> pixel shuffle: each square of `shuffle` patches a side -> one row of their features
    -> adapter: gelu(fc2(gelu(fc1(x)))) (no biases) -> projection: [tiles, tokens_per_tile, decoder]

The layers are qwen_vision.VisionBlock (the encoder layer the towers share: LayerNorms, biased qkv
and o_proj, an ungated MLP), so the weights keep the decoder's names and layouts and their
partition specs (model/sharding.py) split heads, the MLP and the adapter over tensor-parallel
devices. transformers' RoPE multiplies interleaved pairs (x0, x1), (x2, x3)... as complex
numbers, the first quarter of a head's pairs by the patch's column + 1, the second by its row + 1,
the class row by nothing; q's and k's rows are stored de-interleaved
(weights/llama4_vision_layout.py) so that VisionBlock's rotation of halves is the same rotation,
and q . k is unchanged. Every tile is the config's one size, so a run of n tiles is n segments
of num_patches + 1 rows for the bidirectional attention.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.model.config.llama4_vision_config import Llama4VisionConfig
from xlaserve.model.encoders.encoder import LayerNorm
from xlaserve.model.layers import Kernels, init_weight, linear, matmul_input_dtype
from xlaserve.model.transformer import CausalLM
from xlaserve.model.vision.qwen_vision import VisionBlock
from xlaserve.model.vision.siglip_vision import embedded_patches


def tile_rope(config: Llama4VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """float32 (cos, sin) [num_patches + 1, head_dim / 2] of a tile's rows, in the halves
    layout (transformers' Llama4VisionRotaryEmbedding: pair i of the first quarter turns by
    (column + 1) * freq_i, of the second by (row + 1) * freq_i; the class row not at all)."""
    half = config.head_dim // 2
    inv_freq = np.float32(1.0) / (np.float32(config.rope_theta) ** (
        np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    patch = np.arange(config.num_patches)
    side = config.patches_per_side
    columns, rows = (patch % side + 1).astype(np.float32), (patch // side + 1).astype(np.float32)
    angles = np.concatenate([columns[:, None] * inv_freq, rows[:, None] * inv_freq], axis=1)
    angles = np.concatenate([angles, np.zeros((1, half), np.float32)]).astype(np.float32)
    return np.cos(angles), np.sin(angles)


def pixel_shuffle(x: jax.Array, shuffle: int) -> jax.Array:
    """[tiles, side * side, C] -> [tiles, (side / s)^2, C * s^2], transformers' pixel_shuffle
    (ratio 1 / s): its views and permutes in order, so the features of a square line up as
    its adapter's fc1 expects."""
    tiles, rows, channels = x.shape
    side = int(round(rows ** 0.5))
    x = x.reshape(tiles, side, side // shuffle, channels * shuffle).transpose(0, 2, 1, 3)
    x = x.reshape(tiles, side // shuffle, side // shuffle, channels * shuffle ** 2)
    return x.transpose(0, 2, 1, 3).reshape(tiles, -1, channels * shuffle ** 2)


class PixelShuffleAdapter(nnx.Module):
    """transformers' Llama4VisionMLP2 after the shuffle: gelu(fc2(gelu(fc1(x)))), no biases
    (exact GELUs: nn.GELU())."""

    def __init__(self, config: Llama4VisionConfig, dtype, rngs: nnx.Rngs):
        self.up = nnx.Param(init_weight(rngs, (config.intermediate_size, config.projector_dim),
                                        dtype))
        self.down = nnx.Param(init_weight(rngs, (config.projector_dim, config.projector_dim),
                                          dtype))

    def __call__(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        up = jax.nn.gelu(linear(x.astype(matmul_input_dtype(self.up[...])), self.up[...],
                                kernels), approximate=False)
        down = linear(up.astype(matmul_input_dtype(self.down[...])), self.down[...], kernels)
        return jax.nn.gelu(down, approximate=False)


class Llama4VisionTower(nnx.Module):
    def __init__(self, config: Llama4VisionConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.patch_embed = nnx.Param(init_weight(rngs, (c.patch_dim, c.hidden_size), dtype))
        self.class_embedding = nnx.Param(init_weight(rngs, (c.hidden_size,), dtype))
        self.pos_embed = nnx.Param(init_weight(rngs, (c.num_patches + 1, c.hidden_size), dtype))
        self.pre_norm = LayerNorm(c.hidden_size, c.norm_eps, dtype)
        self.blocks = nnx.List([VisionBlock(c, dtype, rngs) for _ in range(c.depth)])
        self.post_norm = LayerNorm(c.hidden_size, c.norm_eps, dtype)
        self.adapter = PixelShuffleAdapter(c, dtype, rngs)
        self.projection = nnx.Param(init_weight(rngs, (c.projector_dim, c.out_hidden_size),
                                                dtype))

    def __call__(self, pixels: jax.Array, kernels: Kernels) -> jax.Array:
        """float32 [tiles, tokens_per_tile, out_hidden_size]: the decoder rows of `pixels`
        [tiles, channels, image_size, image_size] (the processor's, normalized)."""
        c = self.config
        tiles = pixels.shape[0]
        x = embedded_patches(pixels, c, self.patch_embed[...]).reshape(tiles, c.num_patches, -1)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(jnp.float32),
                               (tiles, 1, c.hidden_size))
        x = jnp.concatenate([x, cls], axis=1) + self.pos_embed[...].astype(jnp.float32)
        rows = c.num_patches + 1
        x = self.pre_norm(x.reshape(tiles * rows, -1))
        cos, sin = (jnp.asarray(np.tile(t, (tiles, 1))) for t in tile_rope(c))
        cu_tiles = (jnp.arange(tiles + 1) * rows).astype(jnp.int32)
        count = jnp.full((1,), tiles, jnp.int32)
        for block in self.blocks:
            x = block(x, cos, sin, cu_tiles, count, kernels)
        x = self.post_norm(x).reshape(tiles, rows, -1)[:, :-1]
        x = self.adapter(pixel_shuffle(x, c.shuffle).reshape(tiles * c.tokens_per_tile, -1),
                         kernels)
        out = linear(x.astype(matmul_input_dtype(self.projection[...])), self.projection[...],
                     kernels)
        return out.reshape(tiles, c.tokens_per_tile, -1)


class Llama4VisionLM(CausalLM):
    """Llama4ForConditionalGeneration: the Llama 4 decoder (CausalLM) and its vision encoder,
    which the serving step does not run: the engine runs it per image
    (runtime/executor/towers/llama4_encoder.py) and the step takes its rows in place of the
    <|patch|> tokens' embeddings (`input_embeds`). The image tokens attend causally, as text
    does (transformers' Llama 4 builds no other mask for them)."""

    def __init__(self, config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, rngs=rngs)
        if config.vision is not None:  # None: served for text (vision_config.text_only)
            self.vision = Llama4VisionTower(config.vision, dtype, rngs)
