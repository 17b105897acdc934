"""The vision tower of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (issue 55), ported from
transformers' Qwen2VisionTransformerPretrainedModel / Qwen2_5_VisionTransformerPretrainedModel /
Qwen3VLVisionModel (Qwen3_5VisionModel: Qwen3-VL's without DeepStack).

    x = patches @ patch_embed (+ bias)             (the Conv3d of stride = kernel, as a matmul)
      (+ Qwen3-VL's learned positions, each patch's 4 bilinear taps of the square grid)
    per block:  x = x + o(attention(rope(qkv(norm1(x)))))     (within a window or the image)
                x = x + mlp(norm2(x))
    -> merger: norm, then each 2x2 square of patches (4 rows in a row) -> up -> GELU -> down;
       Qwen3-VL's DeepStack mergers (the square first, then its norm) of its chosen blocks'
       outputs too: [levels, tokens, out]

The host lays the inputs out (model/vision/vision_inputs.py): the patches of one or more images in a
row, in window order for Qwen2.5-VL, each patch's 2D RoPE (cos, sin), and two ragged segment
lists for the attention: the windows (`cu_windows`) and the images (`cu_images`). A block's
attention is the new-token attention with the causal mask off (`Kernels.bidirectional_attention`,
as the encoders'), over the windows or over the images. Padding patches past the last segment
come out as rows nobody reads. Weights use the decoder's names and layouts (qkv [H, heads, 3, D],
o_proj [heads, D, H], gate_up [H, 2, I], down [I, H]), so their partition specs
(model/sharding.py) split the heads and the MLP over the tensor-parallel devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.encoders.encoder import LayerNorm
from xlaserve.model.transformer import CausalLM
from xlaserve.model.layers import (Kernels, RMSNorm, apply_rope, init_weight, matmul_input_dtype,
                                   project, split_qkv)
from xlaserve.model.config.vision_config import VisionConfig

def _norm(config: VisionConfig, dim: int, dtype):
    eps = config.norm_eps
    return RMSNorm(dim, eps, dtype) if config.rms_norms else LayerNorm(dim, eps, dtype)


def _bias(param: nnx.Param) -> jax.Array:
    return param[...].astype(jnp.float32)


def quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu,
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False)}  # Llama 4's (llama4_vision.py)


class VisionBlock(nnx.Module):
    """One pre-norm encoder layer: Qwen-VL's (RoPE'd q and k), SigLIP's (Gemma 3's tower,
    siglip_vision.py: `cos` None, no RoPE; `config` a siglip_config.SiglipConfig) and Llama 4's
    (llama4_vision.py; `config` a llama4_vision_config.Llama4VisionConfig)."""

    def __init__(self, config: VisionConfig, dtype, rngs: nnx.Rngs):
        c, width = config, config.hidden_size
        self.config = c
        self.norm1 = _norm(c, width, dtype)
        self.norm2 = _norm(c, width, dtype)
        self.qkv = nnx.Param(init_weight(rngs, (width, c.num_heads, 3, c.head_dim), dtype))
        self.qkv_bias = nnx.Param(jnp.zeros((c.num_heads, 3, c.head_dim), dtype))
        self.o_proj = nnx.Param(init_weight(rngs, (c.num_heads, c.head_dim, width), dtype))
        self.o_bias = nnx.Param(jnp.zeros((width,), dtype))
        inter = c.intermediate_size
        if c.gated_mlp:  # Qwen2.5-VL: down(silu(gate(x)) * up(x)), biases on all three
            self.gate_up = nnx.Param(init_weight(rngs, (width, 2, inter), dtype))
            self.gate_up_bias = nnx.Param(jnp.zeros((2, inter), dtype))
        else:  # Qwen2-VL, Qwen3-VL: fc2(activation(fc1(x)))
            self.up = nnx.Param(init_weight(rngs, (width, inter), dtype))
            self.up_bias = nnx.Param(jnp.zeros((inter,), dtype))
        self.down = nnx.Param(init_weight(rngs, (inter, width), dtype))
        self.down_bias = nnx.Param(jnp.zeros((width,), dtype))

    def __call__(self, x, cos, sin, cu_seqs, num_seqs, kernels: Kernels) -> jax.Array:
        c = self.config
        dtype = matmul_input_dtype(self.o_proj[...])
        normed = self.norm1(x).astype(matmul_input_dtype(self.qkv[...]))
        qkv = project(normed, self.qkv[...], kernels) + _bias(self.qkv_bias)
        q, k, v = split_qkv(qkv)
        if cos is not None:  # transformers rotates q and k in float32, then rounds them
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k = q.astype(dtype), k.astype(dtype)
        out, _ = kernels.bidirectional_attention(q, k, v.astype(dtype), cu_seqs, num_seqs,
                                                 sm_scale=c.head_dim**-0.5)
        out = project(out.reshape(x.shape[0], -1).astype(dtype), self.o_proj[...], kernels)
        x = x + out + _bias(self.o_bias)
        normed = self.norm2(x)
        if c.gated_mlp:
            gate_up = project(normed.astype(matmul_input_dtype(self.gate_up[...])),
                              self.gate_up[...], kernels) + _bias(self.gate_up_bias)
            hidden = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
        else:
            up = project(normed.astype(matmul_input_dtype(self.up[...])), self.up[...],
                         kernels) + _bias(self.up_bias)
            hidden = ACTIVATIONS[c.activation](up)
        down = project(hidden.astype(matmul_input_dtype(self.down[...])), self.down[...], kernels)
        return x + down + _bias(self.down_bias)


class PatchMerger(nnx.Module):
    """Each `merge_unit` consecutive patches (a 2x2 square: the processor's order) -> one
    decoder token: norm, concatenate, up, GELU (erf), down. `after_merge` (Qwen3-VL's DeepStack
    mergers): concatenate first, then the norm over the square."""

    def __init__(self, config: VisionConfig, dtype, rngs: nnx.Rngs, after_merge: bool = False):
        width = config.hidden_size * config.merge_unit
        self.config, self.after_merge = config, after_merge
        self.norm = _norm(config, width if after_merge else config.hidden_size, dtype)
        self.up = nnx.Param(init_weight(rngs, (width, width), dtype))
        self.up_bias = nnx.Param(jnp.zeros((width,), dtype))
        self.down = nnx.Param(init_weight(rngs, (width, config.out_hidden_size), dtype))
        self.down_bias = nnx.Param(jnp.zeros((config.out_hidden_size,), dtype))

    def __call__(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        rows = x.shape[0] // self.config.merge_unit
        dtype = matmul_input_dtype(self.up[...])
        if self.after_merge:
            x = self.norm(x.reshape(rows, -1)).astype(dtype)
        else:
            x = self.norm(x).astype(dtype).reshape(rows, -1)
        up = jax.nn.gelu(project(x, self.up[...], kernels) + _bias(self.up_bias),
                         approximate=False)
        down = project(up.astype(matmul_input_dtype(self.down[...])), self.down[...], kernels)
        return down + _bias(self.down_bias)


class VisionTower(nnx.Module):
    def __init__(self, config: VisionConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.patch_embed = nnx.Param(init_weight(rngs, (c.patch_dim, c.hidden_size), dtype))
        if c.num_position_embeddings:  # Qwen3-VL: a biased patch embedding, learned positions
            self.patch_embed_bias = nnx.Param(jnp.zeros((c.hidden_size,), dtype))
            self.pos_embed = nnx.Param(init_weight(rngs, (c.num_position_embeddings,
                                                          c.hidden_size), dtype))
        self.blocks = nnx.List([VisionBlock(c, dtype, rngs) for _ in range(c.depth)])
        self.merger = PatchMerger(c, dtype, rngs)
        self.deepstack_mergers = nnx.List([PatchMerger(c, dtype, rngs, after_merge=True)
                                           for _ in c.deepstack_layers])

    def __call__(self, patches, cos, sin, cu_windows, num_windows, cu_images, num_images,
                 pos_index, pos_weight, kernels: Kernels) -> jax.Array:
        """float32[levels, P / merge_unit, out_hidden_size]: the merged rows of `patches`
        [P, patch_dim] (model/vision/vision_inputs.py lays them out: their order, the RoPE (cos,
        sin) [P, head_dim / 2] of each, the windows' and the images' segments, and Qwen3-VL's
        position taps i32/f32[P, 4]), then the DeepStack layers' (VisionConfig.levels)."""
        c = self.config
        weight = self.patch_embed[...]
        x = jnp.dot(patches.astype(weight.dtype), weight, preferred_element_type=jnp.float32)
        if c.num_position_embeddings:
            x = x + _bias(self.patch_embed_bias)
            table = self.pos_embed[...]
            x = x + (table[pos_index].astype(jnp.float32) * pos_weight[..., None]).sum(1)
        deepstack = []
        for index, block in enumerate(self.blocks):
            windowed = c.windowed(index)
            x = block(x, cos, sin, cu_windows if windowed else cu_images,
                      num_windows if windowed else num_images, kernels)
            if index in c.deepstack_layers:
                merger = self.deepstack_mergers[c.deepstack_layers.index(index)]
                deepstack.append(merger(x, kernels))
        return jnp.stack([self.merger(x, kernels)] + deepstack)


class VisionLanguageLM(CausalLM):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5: the decoder (CausalLM, with multimodal RoPE
    from the host; Qwen3.5's with its linear layers' states) and its vision tower, which the
    serving step does not run: the engine runs it per image (runtime/executor/vision_encoder.py)
    and the step takes its rows in place of the image placeholders' embeddings
    (`CausalLM.hidden_states`' `input_embeds`)."""

    def __init__(self, config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, rngs=rngs)
        self.vision = VisionTower(config.vision, dtype, rngs)
