"""Llama4VisionConfig: Llama 4's vision encoder (Llama-4-Scout-17B-16E, Maverick;
model/vision/llama4_vision.py) and its multi-modal projector, read from a
Llama4ForConditionalGeneration config's `vision_config` and top level; what the encoder does not
run stops the load in one line.

The encoder (transformers' Llama4VisionModel): a tile of `image_size` square pixels cut into
`patch_size` patches (nn.Unfold then a linear, no bias), a class embedding appended after the
patches, one learned position per row, a LayerNorm before and after `depth` pre-norm layers
(attention with biases and a 2D RoPE over the patch grid, fc1 -> GELU (erf) -> fc2 with biases;
every LayerNorm's eps 1e-5, as transformers builds them), the class row dropped, then the
pixel-shuffle adapter: each square of 1 / pixel_shuffle_ratio patches a side becomes one row
(1 / ratio^2 patches' features side by side), fc1 -> GELU -> fc2 -> GELU without biases; the
projector (`multi_modal_projector.linear_1`, no bias) into the decoder's width. A tile is
`tokens_per_tile` decoder tokens (Scout: 24 x 24 patches -> 144).

transformers hard-codes the GELUs (nn.GELU(), not `hidden_act`), the LayerNorms' eps and the
projector's missing bias, and reads neither `norm_eps` nor `multi_modal_projector_bias`: neither
is read here. The image processor and the prompt's tokens: model/vision/llama4_tiles.py,
runtime/engine/llama4_images.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from xlaserve.model.config.siglip_config import SquarePatchGrid

LLAMA4_IMAGES = "Llama4ForConditionalGeneration"


@dataclasses.dataclass(frozen=True)
class Llama4VisionConfig(SquarePatchGrid):
    depth: int
    hidden_size: int  # the encoder's width
    num_heads: int
    intermediate_size: int  # its MLP's, which is also the adapter's input (shuffled patches)
    image_size: int  # a tile's pixels a side
    patch_size: int
    in_channels: int
    shuffle: int  # patches a side merged by the adapter: 1 / pixel_shuffle_ratio (Scout: 2)
    projector_dim: int  # the adapter's width (projector_input_dim = projector_output_dim)
    out_hidden_size: int  # the decoder's hidden size: the projector's output
    rope_theta: float
    # The prompt's tokens (the checkpoint's config): one `image_token_id` (<|patch|>) per row of
    # the encoder's output, between `boi_token_id` (<|image_start|>) and `eoi_token_id`
    # (<|image_end|>); the tokenizer names the rest (runtime/engine/llama4_images.py).
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    kind: str = "llama4"  # VisionConfig.from_dict tells the configs apart by it

    # What model/vision/qwen_vision.VisionBlock (the encoder layer the towers share) reads.
    gated_mlp = False
    rms_norms = False
    activation = "gelu"
    norm_eps = 1e-5  # transformers' nn.LayerNorm default: every norm of the encoder
    levels = 1  # rows an image token has for the decoder: its embedding alone

    @property
    def tokens_per_tile(self) -> int:
        return self.num_patches // self.shuffle ** 2

    @classmethod
    def from_dict(cls, data: dict) -> "Llama4VisionConfig":
        return cls(**data)


def llama4_vision_from_hf(hf_config: Any, architecture: str, text_hidden: int
                          ) -> Llama4VisionConfig:
    """Llama4ForConditionalGeneration's encoder and projector; a field they do not run raises.
    `text_hidden`: the decoder's width."""
    v = hf_config.vision_config

    def refuse(what: str):
        raise ValueError(f"{architecture}: vision_config {what}")

    size, patch = v.image_size, v.patch_size
    if not isinstance(size, int) or not isinstance(patch, int):
        refuse(f"image_size {size!r} and patch_size {patch!r} as pairs are not supported "
               "(square tiles and patches, as published)")
    if size % patch:
        refuse(f"image_size {size} is not a whole number of {patch}-pixel patches")
    width, heads = int(v.hidden_size), int(v.num_attention_heads)
    if width % heads or (width // heads) % 4:
        refuse(f"hidden_size {width} over {heads} heads: a head must be a multiple of 4 wide "
               "(its 2D RoPE rotates a quarter of it by each axis)")
    ratio = float(v.pixel_shuffle_ratio)
    shuffle = round(1 / ratio) if ratio > 0 else 0
    if shuffle < 1 or abs(shuffle * ratio - 1) > 1e-9 or (size // patch) % shuffle:
        refuse(f"pixel_shuffle_ratio {ratio} is not 1 / n for an n dividing the {size // patch} "
               "patches a side")
    if v.intermediate_size != width * shuffle ** 2:
        refuse(f"intermediate_size {v.intermediate_size} is not the shuffled patches' width "
               f"{width * shuffle ** 2} (hidden_size / pixel_shuffle_ratio^2), which "
               "transformers' adapter takes")
    if not v.projector_input_dim == v.projector_output_dim == v.vision_output_dim:
        refuse(f"projector_input_dim {v.projector_input_dim}, projector_output_dim "
               f"{v.projector_output_dim} and vision_output_dim {v.vision_output_dim} differ "
               "(transformers' adapter and projector take them as one width)")
    rope = dict(getattr(v, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        refuse(f"rope type {rope['rope_type']!r} is not supported (default)")
    return Llama4VisionConfig(
        depth=int(v.num_hidden_layers), hidden_size=width, num_heads=heads,
        intermediate_size=int(v.intermediate_size), image_size=int(size), patch_size=int(patch),
        in_channels=int(v.num_channels), shuffle=shuffle,
        projector_dim=int(v.projector_output_dim), out_hidden_size=int(text_hidden),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=int(hf_config.image_token_id), boi_token_id=int(hf_config.boi_token_id),
        eoi_token_id=int(hf_config.eoi_token_id))
