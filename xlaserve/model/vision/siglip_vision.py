"""Gemma 3's vision tower and projector (gemma-3-4b/12b/27b-it), ported from transformers'
SiglipVisionModel (no head) and Gemma3MultiModalProjector, and `Gemma3VisionLM`, the decoder
beside them.

    x = patches @ patch_embed + bias + positions      (the Conv2d of stride = kernel, a matmul;
                                                       one learned position per patch)
    per layer:  x = x + o(attention(qkv(norm1(x))))   (over its image, no RoPE)
                x = x + fc2(gelu_tanh(fc1(norm2(x))))
    x = post_norm(x)
    -> the patch grid average-pooled to tokens_per_image squares, Gemma's RMSNorm (1 + weight),
       @ projection: [images, tokens_per_image, decoder hidden]

The layers are qwen_vision.VisionBlock (the encoder layer both towers share: LayerNorms, biased
qkv and o_proj, an ungated MLP; RoPE off), so the weights keep the decoder's names and layouts
and their partition specs (model/sharding.py) split heads and the MLP over tensor-parallel
devices. Every image is the config's one size (the processor resizes it), so a run of n images
is n segments of `num_patches` rows for the bidirectional attention.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.config.siglip_config import SiglipConfig
from xlaserve.model.encoders.encoder import LayerNorm
from xlaserve.model.layers import Kernels, RMSNorm, init_weight, linear, matmul_input_dtype
from xlaserve.model.transformer import CausalLM
from xlaserve.model.vision.qwen_vision import VisionBlock
from xlaserve.pallas_kernels.ragged_paged_attention.image_spans import image_spans


def embedded_patches(pixels: jax.Array, config, weight: jax.Array) -> jax.Array:
    """float32 [n * num_patches, width]: the patches of `pixels` [n, channels, S, S] (each
    patch's pixels in the Conv2d weight's order, channel, row, column, as nn.Unfold's; patches
    row-major, as the conv's output flattens) times `weight` [patch_dim, width]. SigLIP's and
    Llama 4's (llama4_vision.py); `config` a SquarePatchGrid."""
    c, side, size = config, config.patches_per_side, config.patch_size
    patches = pixels.reshape(pixels.shape[0], c.in_channels, side, size, side, size)
    patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(pixels.shape[0] * c.num_patches, -1)
    return jnp.dot(patches.astype(weight.dtype), weight, preferred_element_type=jnp.float32)


class SiglipTower(nnx.Module):
    def __init__(self, config: SiglipConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.patch_embed = nnx.Param(init_weight(rngs, (c.patch_dim, c.hidden_size), dtype))
        self.patch_embed_bias = nnx.Param(jnp.zeros((c.hidden_size,), dtype))
        self.pos_embed = nnx.Param(init_weight(rngs, (c.num_patches, c.hidden_size), dtype))
        self.blocks = nnx.List([VisionBlock(c, dtype, rngs) for _ in range(c.depth)])
        self.post_norm = LayerNorm(c.hidden_size, c.norm_eps, dtype)
        self.projector_norm = RMSNorm(c.hidden_size, c.norm_eps, dtype, offset=1.0)
        self.projection = nnx.Param(init_weight(rngs, (c.hidden_size, c.out_hidden_size), dtype))

    def __call__(self, pixels: jax.Array, kernels: Kernels) -> jax.Array:
        """float32 [n, tokens_per_image, out_hidden_size]: the decoder rows of `pixels`
        [n, channels, image_size, image_size] (the processor's, normalized)."""
        c = self.config
        images, weight = pixels.shape[0], self.patch_embed[...]
        x = embedded_patches(pixels, c, weight)
        x = x + self.patch_embed_bias[...].astype(jnp.float32)
        x = x + jnp.tile(self.pos_embed[...].astype(jnp.float32), (images, 1))
        cu_images = (jnp.arange(images + 1) * c.num_patches).astype(jnp.int32)
        count = jnp.full((1,), images, jnp.int32)
        for block in self.blocks:
            x = block(x, None, None, cu_images, count, kernels)
        x = self.post_norm(x).astype(weight.dtype)  # the tower's output, in the model dtype
        # Average-pooled squares of `pool` patches a side (transformers' AvgPool2d).
        ts, pool = c.tokens_per_side, c.pool
        x = x.astype(jnp.float32).reshape(images, ts, pool, ts, pool, -1).mean(axis=(2, 4))
        x = x.astype(weight.dtype)
        normed = self.projector_norm(x.reshape(images * ts * ts, -1))
        rows = linear(normed.astype(matmul_input_dtype(self.projection[...])),
                      self.projection[...], kernels)
        return rows.reshape(images, ts * ts, -1)


class Gemma3VisionLM(CausalLM):
    """Gemma3ForConditionalGeneration: the Gemma 3 decoder (CausalLM) and its SigLIP tower,
    which the serving step does not run: the engine runs it per image
    (runtime/executor/towers/siglip_encoder.py) and the step takes its rows in place of the image
    tokens' embeddings (`input_embeds`, unscaled: transformers scales text embeddings by
    sqrt(hidden), not the projector's rows). A step with images has its image tokens attend to
    their whole image (pallas_kernels/ragged_paged_attention/image_spans.py). Gemma 4's
    (model/vision/gemma4_vision.py) is this with its own tower (`tower`)."""

    tower = SiglipTower  # the vision model beside the decoder, built from config.vision

    def __init__(self, config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, rngs=rngs)
        if config.vision is not None:  # None: served for text (vision_config.text_only)
            self.vision = self.tower(config.vision, dtype, rngs)

    def hidden_states(self, input_ids, positions, kv_caches, metadata, kernels: Kernels,
                      rope=None, capture=None, lora=None, input_embeds=None):
        """CausalLM.hidden_states, the step's images (its rows with negative ids) found first
        where it takes image rows (`input_embeds`) and its images' tokens see the whole image
        (`whole_images`: Gemma 3's, and Gemma 4's where its config says)."""
        v = self.config.vision
        if input_embeds is not None and v.whole_images:
            metadata = dataclasses.replace(metadata, image_spans=image_spans(
                input_ids, positions, metadata.cu_q_lens, metadata.page_indices,
                v.tokens_per_image, v.fewest_tokens, v.sliding_layers_only))
        return super().hidden_states(input_ids, positions, kv_caches, metadata, kernels, rope,
                                     capture, lora, input_embeds)
