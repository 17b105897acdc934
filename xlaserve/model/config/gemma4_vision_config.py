"""Gemma4VisionConfig: Gemma 4's vision tower (gemma-4-31b-it, 26b-a4b-it, e2b-it, e4b-it;
model/vision/gemma4_vision.py) and its embedder into the decoder, read from a
Gemma4ForConditionalGeneration config's `vision_config`, top level and text config; what the
tower does not run stops the load in one line.

The tower (transformers' Gemma4VisionModel, the tests' oracle): an image resized by the
processor to at most `tokens_per_image` x pooling^2 patches of `patch_size` pixels, its aspect
ratio kept, each side a multiple of pooling x patch_size; each patch's pixels (in [0, 1]) scaled
to [-1, 1] and projected without a bias, plus a learned position per column and per row (a
[2, position_embedding_size, width] table); pre- and post-normed layers (RMSNorms multiplying by
their weight) whose attention has q and k norms, weightless value norms, an unscaled softmax and
a 2-D RoPE (a head's first half rotated by the patch's column, its second by its row);
GeGLU MLPs; with `use_clipped_linears` each projection's input and output clamped to bounds
stored in the checkpoint (e2b, e4b). Then each pooling x pooling square of patches averaged into
one token, times sqrt(width), with `standardize` (31B, 26B) shifted and scaled by stored
vectors; the embedder (Gemma4MultimodalEmbedder): a weightless RMS norm and a projection to the
decoder's width. The rows are the image tokens' embeddings, not scaled by sqrt(hidden) as
Gemma's text embeddings are.

Which layers' image tokens see their whole image: the text config's use_bidirectional_attention
"vision" (31B, 26B) makes them do so in the sliding layers (the full layers stay causal); None
(e2b, e4b) keeps them causal.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger(__name__)

# transformers' names of the tanh-approximated GELU (ACT2FN: both are the same formula).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")
# The processor's allowed image sizes (transformers' _SUPPORTED_SOFT_TOKENS); 280 the default.
DEFAULT_TOKENS_PER_IMAGE = 280


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
    depth: int
    hidden_size: int  # the tower's width
    num_heads: int
    head_dim: int
    intermediate_size: int
    out_hidden_size: int  # the decoder's hidden size: the embedder's output
    patch_size: int
    pooling: int  # patches a side of one token's averaged square (pooling_kernel_size)
    position_embedding_size: int  # learned positions per axis
    norm_eps: float
    rope_theta: float
    clipped: bool  # use_clipped_linears: every projection's input and output clamped
    standardize: bool
    tokens_per_image: int  # the most tokens an image becomes (the processor's max_soft_tokens)
    # use_bidirectional_attention "vision": an image's tokens see the whole image in the
    # sliding layers (image_spans.py); else causal throughout.
    whole_images: bool
    # The prompt's tokens: the chat template's `<|image|>` (image_token_id) per image, expanded
    # to boi + one image token per soft token + eoi (transformers' Gemma4Processor).
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    in_channels: int = 3
    kind: str = "gemma4"  # VisionConfig.from_dict tells the configs apart by it

    levels = 1  # rows an image token has for the decoder: its embedding alone
    sliding_layers_only = True  # where whole images are seen (image_spans.ImageSpans)

    @property
    def patch_dim(self) -> int:
        """The values of one patch: pixels x pixels x channels (the processor's order)."""
        return self.in_channels * self.patch_size ** 2

    @property
    def max_patches(self) -> int:
        return self.tokens_per_image * self.pooling ** 2

    @property
    def fewest_tokens(self) -> int:
        """The fewest tokens the processor makes of an image: its sides are a x b tokens'
        worth with a b = tokens_per_image, rounded down each (one side under one token's: that
        side one token, the other the whole budget), and floor(x) >= 2x/3 for x >= 2, > x - 1
        for x >= 1, so floor(a) floor(b) >= 4/9 of the budget (124 of 280)."""
        return 4 * self.tokens_per_image // 9

    @classmethod
    def from_dict(cls, data: dict) -> "Gemma4VisionConfig":
        return cls(**data)


def gemma4_vision_from_hf(hf_config: Any, architecture: str,
                          text_hidden: int) -> Gemma4VisionConfig:
    """Gemma4ForConditionalGeneration's tower and embedder; a field they do not run raises.
    `text_hidden`: the decoder's width."""
    v, text = hf_config.vision_config, hf_config.text_config
    if v is None:
        raise ValueError(f"{architecture}: the config has no vision_config")
    activation = getattr(v, "hidden_activation", None)
    if activation not in _GELU_TANH:
        raise ValueError(f"{architecture}: vision hidden_activation {activation!r} is not "
                         f"supported ({', '.join(_GELU_TANH)})")
    if v.num_key_value_heads != v.num_attention_heads:
        raise ValueError(f"{architecture}: vision num_key_value_heads {v.num_key_value_heads} "
                         f"other than its {v.num_attention_heads} heads is not supported")
    if getattr(v, "attention_bias", False):
        raise ValueError(f"{architecture}: vision attention_bias is not supported")
    if v.head_dim % 4:
        raise ValueError(f"{architecture}: vision head_dim {v.head_dim} is not a multiple of 4 "
                         "(its 2-D RoPE rotates pairs in each half)")
    rope = dict(getattr(v, "rope_parameters", None) or {})
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ValueError(f"{architecture}: vision rope_type {rope['rope_type']!r} is not "
                         "supported (axial)")
    bidirectional = getattr(text, "use_bidirectional_attention", None)
    if bidirectional not in (None, "vision"):
        raise ValueError(f"{architecture}: use_bidirectional_attention={bidirectional!r} is not "
                         "supported (None, \"vision\")")
    if getattr(text, "hidden_size_per_layer_input", 0) and text.pad_token_id != 0:
        # Image tokens read the per-layer embedding of the pad token (model/per_layer_inputs.py
        # takes row 0 for them).
        raise ValueError(f"{architecture}: per-layer embeddings with pad_token_id "
                         f"{text.pad_token_id} (not 0) are not supported with images")
    if getattr(hf_config, "audio_config", None) is not None:
        logger.warning("%s: its audio tower is not supported: requests with audio are refused",
                       architecture)
    tokens = int(getattr(hf_config, "vision_soft_tokens_per_image", None)
                 or getattr(v, "default_output_length", None) or DEFAULT_TOKENS_PER_IMAGE)
    if tokens * v.pooling_kernel_size > v.position_embedding_size:
        raise ValueError(f"{architecture}: an image of {tokens} tokens may be {tokens} tokens "
                         f"({tokens * v.pooling_kernel_size} patches) long, past the vision "
                         f"position_embedding_size {v.position_embedding_size}")
    return Gemma4VisionConfig(
        depth=int(v.num_hidden_layers), hidden_size=int(v.hidden_size),
        num_heads=int(v.num_attention_heads), head_dim=int(v.head_dim),
        intermediate_size=int(v.intermediate_size), out_hidden_size=int(text_hidden),
        patch_size=int(v.patch_size), pooling=int(v.pooling_kernel_size),
        position_embedding_size=int(v.position_embedding_size), norm_eps=float(v.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", 100.0)), clipped=bool(v.use_clipped_linears),
        standardize=bool(v.standardize), tokens_per_image=tokens,
        whole_images=bidirectional == "vision",
        image_token_id=int(hf_config.image_token_id), boi_token_id=int(hf_config.boi_token_id),
        eoi_token_id=int(hf_config.eoi_token_id))
