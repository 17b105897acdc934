"""SiglipConfig: Gemma 3's vision tower (gemma-3-4b/12b/27b-it's SigLIP, model/vision/siglip_vision.py)
and its multimodal projector, read from a Gemma3ForConditionalGeneration config's `vision_config`
and top level; what the tower does not run stops the load in one line.

The tower (transformers' SiglipVisionModel, no head): an image resized to `image_size` square
cut into `patch_size` patches (the Conv2d of stride = kernel, as a matmul), learned positions
(one per patch: no interpolation, the processor resizes every image to the one size), pre-norm
encoder layers (LayerNorm, attention with biases, fc1 -> GELU (tanh) -> fc2), a final
LayerNorm. The projector (transformers' Gemma3MultiModalProjector): the patch grid average-pooled
to `tokens_per_image` tokens (a square), Gemma's RMSNorm (1 + weight), a projection to the
decoder's width. An image is `tokens_per_image` decoder tokens whose embeddings are the
projector's rows, not scaled by sqrt(hidden) as Gemma's text embeddings are.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

# transformers' names of the tanh-approximated GELU (ACT2FN: both are the same formula).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")


class SquarePatchGrid:
    """The shapes of a tower over square images of `image_size` pixels cut in `patch_size`
    patches, and of its heads: SiglipConfig's, and Llama 4's encoder's
    (llama4_vision_config.Llama4VisionConfig)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def patch_dim(self) -> int:
        """The values of one patch: channels x pixels x pixels (the Conv2d weight's order, and
        nn.Unfold's)."""
        return self.in_channels * self.patch_size ** 2


@dataclasses.dataclass(frozen=True)
class SiglipConfig(SquarePatchGrid):
    depth: int
    hidden_size: int  # the tower's width
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the decoder's hidden size: the projector's output
    image_size: int  # pixels a side, every image resized to it
    patch_size: int
    in_channels: int
    norm_eps: float
    tokens_per_image: int  # decoder tokens an image becomes (mm_tokens_per_image, a square)
    # The prompt's tokens: `<start_of_image>` where the template puts an image, expanded to
    # "\n\n" + boi + tokens_per_image image tokens + eoi + "\n\n" (transformers' processor).
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    kind: str = "gemma3"  # VisionConfig.from_dict tells the two configs apart by it

    # What model/vision/qwen_vision.VisionBlock (the encoder layer both towers share) reads.
    gated_mlp = False
    rms_norms = False
    activation = "gelu_tanh"
    levels = 1  # rows an image token has for the decoder: its embedding alone
    # An image's tokens see the whole image in every layer (image_spans.py), all of one length.
    whole_images = True
    sliding_layers_only = False

    @property
    def fewest_tokens(self) -> int:
        return self.tokens_per_image

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.tokens_per_image)

    @property
    def pool(self) -> int:
        """Patches a side of one decoder token's average-pooled square."""
        return self.patches_per_side // self.tokens_per_side

    @classmethod
    def from_dict(cls, data: dict) -> "SiglipConfig":
        return cls(**data)


def siglip_from_hf(hf_config: Any, architecture: str, text_hidden: int) -> SiglipConfig:
    """Gemma3ForConditionalGeneration's tower and projector; a field they do not run raises.
    `text_hidden`: the decoder's width."""
    v = hf_config.vision_config
    activation = getattr(v, "hidden_act", None)
    if activation not in _GELU_TANH:
        raise ValueError(f"{architecture}: vision hidden_act {activation!r} is not supported "
                         f"({', '.join(_GELU_TANH)})")
    if v.hidden_size % v.num_attention_heads:
        raise ValueError(f"{architecture}: vision width {v.hidden_size} is not a multiple of its "
                         f"{v.num_attention_heads} heads")
    if v.image_size % v.patch_size:
        raise ValueError(f"{architecture}: vision image_size {v.image_size} is not a whole "
                         f"number of {v.patch_size}-pixel patches")
    tokens = int(hf_config.mm_tokens_per_image)
    side, patches = math.isqrt(tokens), v.image_size // v.patch_size
    if side * side != tokens or side < 1 or patches % side:
        raise ValueError(f"{architecture}: mm_tokens_per_image {tokens} is not a square whose "
                         f"side divides the {patches} patches a side")
    return SiglipConfig(
        depth=int(v.num_hidden_layers), hidden_size=int(v.hidden_size),
        num_heads=int(v.num_attention_heads), intermediate_size=int(v.intermediate_size),
        out_hidden_size=int(text_hidden), image_size=int(v.image_size),
        patch_size=int(v.patch_size), in_channels=int(getattr(v, "num_channels", 3)),
        norm_eps=float(v.layer_norm_eps), tokens_per_image=tokens,
        image_token_id=int(hf_config.image_token_id), boi_token_id=int(hf_config.boi_token_id),
        eoi_token_id=int(hf_config.eoi_token_id))
