"""VisionConfig: the vision tower of a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 checkpoint
(model/vision/qwen_vision.py), read from its Hugging Face `vision_config`; what the tower does not
run stops the load in one line. The decoder beside it (a Qwen2 decoder, Qwen3's for Qwen3-VL,
Qwen3.5's hybrid text model for Qwen3.5, with experts for Qwen3.5-MoE) has multimodal RoPE
(`RopeConfig.mrope_section`), built by encoder_config.vision_language_config.

Qwen2-VL: LayerNorms, an MLP of fc1 -> quick_gelu -> fc2, full attention in every block.
Qwen2.5-VL: RMSNorms, a gated SiLU MLP with biases, attention within windows of
`window_size` pixels but in `fullatt_blocks`. Qwen3-VL: LayerNorms, fc1 -> GELU (tanh) -> fc2,
full attention, a patch embedding with a bias, learned positions resampled (bilinear) to each
image's grid, and DeepStack: the outputs of `deepstack_layers` merged too and added to the
decoder's first layers' outputs at the image's tokens. Qwen3.5 (and Qwen3.5-MoE): Qwen3-VL's
tower without DeepStack (kind "qwen3_vl", no `deepstack_layers`). All: patches of `patch_size` pixels over 2
frames (an image is its frame twice), 2D RoPE, and a merger of each 2x2 patch square into one
decoder token.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from xlaserve.model.config.llama4_vision_config import Llama4VisionConfig
from xlaserve.model.config.gemma4_vision_config import Gemma4VisionConfig
from xlaserve.model.config.siglip_config import SiglipConfig

# architectures[0] -> VisionConfig.kind
VISION_LANGUAGE_ARCHITECTURES = {"Qwen2VLForConditionalGeneration": "qwen2_vl",
                                 "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                                 "Qwen3VLForConditionalGeneration": "qwen3_vl",
                                 "Qwen3_5ForConditionalGeneration": "qwen3_vl",
                                 "Qwen3_5MoeForConditionalGeneration": "qwen3_vl"}
# Qwen3-VL-kind towers without DeepStack: transformers' Qwen3_5VisionModel (Qwen3_5MoeVisionModel
# too) has no DeepStack mergers, whatever `deepstack_visual_indexes` its config may hold.
NO_DEEPSTACK = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
# The MLP's activation by kind (a gated SiLU: Qwen2.5-VL's).
ACTIVATIONS = {"qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu", "qwen3_vl": "gelu_tanh"}
_HF_ACTIVATIONS = {"qwen2_vl": ("quick_gelu",), "qwen2_5_vl": ("silu",),
                   "qwen3_vl": ("gelu_pytorch_tanh", "gelu_tanh")}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    kind: str  # "qwen2_vl" | "qwen2_5_vl" | "qwen3_vl"
    depth: int
    hidden_size: int  # the tower's width
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the decoder's hidden size: the merger's output
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    rope_theta: float
    # Qwen2.5-VL: attention within windows of this many pixels a side but in `fullatt_blocks`;
    # 0: every block attends over its whole image (Qwen2-VL).
    window_size: int = 0
    fullatt_blocks: tuple[int, ...] = ()
    # Qwen3-VL: the learned positions' square grid (entries; 0: none), and the blocks whose
    # outputs are merged for DeepStack (the decoder's layer i adds the i-th's).
    num_position_embeddings: int = 0
    deepstack_layers: tuple[int, ...] = ()
    # The placeholder tokens (the checkpoint's config): one `image_token_id` per merged patch.
    image_token_id: int = -1
    video_token_id: int = -1
    vision_start_token_id: int = -1
    vision_end_token_id: int = -1
    norm_eps = 1e-6  # every norm of the three towers (not a field: no config sets it)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The values of one patch: channels x frames x pixels x pixels (the processor's rows)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one decoder token."""
        return self.spatial_merge_size ** 2

    @property
    def gated_mlp(self) -> bool:
        return self.kind == "qwen2_5_vl"

    @property
    def rms_norms(self) -> bool:
        return self.kind == "qwen2_5_vl"

    @property
    def activation(self) -> str:
        return ACTIVATIONS[self.kind]

    @property
    def levels(self) -> int:
        """Rows an image token has for the decoder: its embedding, then one per DeepStack layer."""
        return 1 + len(self.deepstack_layers)

    def windowed(self, block: int) -> bool:
        """Whether block `block` attends within windows (else over its whole image)."""
        return bool(self.window_size) and block not in self.fullatt_blocks

    @property
    def merged_per_window(self) -> int:
        """Merged tokens along a window's side (Qwen2.5-VL: 112 px / 14 / 2 = 4)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_dict(cls, data: dict) -> "VisionConfig":
        """A tower's config from its `to_dict`: this one's, Gemma 3's SigLIP
        (siglip_config.SiglipConfig, kind "gemma3"), Llama 4's encoder
        (llama4_vision_config.Llama4VisionConfig, kind "llama4") or Gemma 4's tower
        (gemma4_vision_config.Gemma4VisionConfig, kind "gemma4"), which ModelConfig.vision holds
        too."""
        if data.get("kind") == "gemma3":
            return SiglipConfig.from_dict(data)
        if data.get("kind") == "llama4":
            return Llama4VisionConfig.from_dict(data)
        if data.get("kind") == "gemma4":
            return Gemma4VisionConfig.from_dict(data)
        return cls(**{**data, "fullatt_blocks": tuple(data.get("fullatt_blocks", ())),
                      "deepstack_layers": tuple(data.get("deepstack_layers", ()))})


def vision_from_hf(hf_config: Any, architecture: str) -> VisionConfig:
    """The tower of a VISION_LANGUAGE_ARCHITECTURES checkpoint; a field it does not run raises."""
    kind = VISION_LANGUAGE_ARCHITECTURES[architecture]
    v = hf_config.vision_config
    rope = dict(getattr(v, "rope_parameters", None) or {})
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ValueError(f"{architecture}: vision rope type {rope['rope_type']!r} is not supported")
    if v.hidden_act not in _HF_ACTIVATIONS[kind]:
        raise ValueError(f"{architecture}: vision hidden_act {v.hidden_act!r} is not supported "
                         f"({_HF_ACTIVATIONS[kind][0]})")
    window, full, positions, deepstack = 0, (), 0, ()
    if kind == "qwen2_vl":
        width, out, inter = v.embed_dim, v.hidden_size, int(v.embed_dim * v.mlp_ratio)
    else:
        width, out, inter = v.hidden_size, v.out_hidden_size, v.intermediate_size
    if kind == "qwen2_5_vl":
        window, full = int(v.window_size), tuple(int(i) for i in v.fullatt_block_indexes)
        if window % (v.patch_size * v.spatial_merge_size):
            raise ValueError(f"{architecture}: window_size {window} is not a whole number of "
                             f"merged patches ({v.patch_size * v.spatial_merge_size} px)")
    if kind == "qwen3_vl":
        positions = int(v.num_position_embeddings)
        if int(positions ** 0.5) ** 2 != positions:
            raise ValueError(f"{architecture}: num_position_embeddings {positions} is not a "
                             "square grid")
        if architecture not in NO_DEEPSTACK:
            deepstack = tuple(int(i) for i in v.deepstack_visual_indexes)
        if any(not 0 <= i < v.depth for i in deepstack):
            raise ValueError(f"{architecture}: deepstack_visual_indexes {list(deepstack)} are "
                             f"not blocks of its {v.depth}")
    if width % v.num_heads:
        raise ValueError(f"{architecture}: vision width {width} is not a multiple of its "
                         f"{v.num_heads} heads")
    return VisionConfig(
        kind=kind, depth=v.depth, hidden_size=width, num_heads=v.num_heads,
        intermediate_size=inter, out_hidden_size=out, patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size, in_channels=v.in_channels,
        spatial_merge_size=v.spatial_merge_size,
        rope_theta=float(rope.get("rope_theta", 10000.0)), window_size=window,
        fullatt_blocks=full, num_position_embeddings=positions, deepstack_layers=deepstack,
        image_token_id=int(hf_config.image_token_id),
        video_token_id=int(getattr(hf_config, "video_token_id", -1) or -1),
        vision_start_token_id=int(hf_config.vision_start_token_id),
        vision_end_token_id=int(getattr(hf_config, "vision_end_token_id", -1) or -1))


# Image checkpoints whose decoder serves text without the tower (`text_only`): the vision
# towers beside a plain CausalLM's layers (Gemma 3's and 4's, Llama 4's). Qwen-VL's decoder
# takes its multimodal RoPE positions from the tower's code.
TEXT_SERVABLE_TOWERS = ("gemma3", "gemma4", "llama4")


def text_only(config):
    """`config` (a ModelConfig) without its vision tower, where its decoder serves text alone
    (--limit-mm-per-prompt '{"image": 0}', vLLM's way of turning a modality off): the tower is
    neither read nor held, and what a vision model refuses (--quantization, speculation, LoRA,
    several hosts) is open again. A tower whose decoder needs it is refused by name."""
    if config.vision is None:
        return config
    if config.vision.kind not in TEXT_SERVABLE_TOWERS:
        raise ValueError(f"--limit-mm-per-prompt '{{\"image\": 0}}': {config.architecture}'s "
                         "decoder is not served without its vision tower (text-only: "
                         f"{', '.join(TEXT_SERVABLE_TOWERS)} towers' models)")
    return dataclasses.replace(config, vision=None)
