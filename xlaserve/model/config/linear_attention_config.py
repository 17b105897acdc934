"""Hybrid linear-attention decoders (issue 76): Qwen3.5's text models (`Qwen3_5ForCausalLM`, and
`Qwen3_5MoeForCausalLM` with experts in every layer: experts_config.py) and Qwen3-Next
(`Qwen3NextForCausalLM`). Three of every four layers are Gated DeltaNet
(model/linear_attention.py), which keeps a per-request state instead of a KV cache; the fourth is
full attention with Qwen's gate on its output (`attention_output_gate`: q_proj twice as wide, each
head's queries then its gate), q and k norms, and RoPE on a quarter of each head
(`partial_rotary_factor`, rope_config.py). Their RMSNorms multiply by 1 + weight (Qwen3-Next's
zero-centred norms, `norm_offset`), the gated norm inside a linear layer by its plain weight.
`hybrid_fields` gives ModelConfig's fields for them; what model/transformer.py does not run is
refused in one line.
"""
from __future__ import annotations

import dataclasses
from typing import Any

HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
_LAYER_KINDS = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """A Gated DeltaNet layer's shapes (transformers' `linear_*` config fields)."""

    hidden_size: int
    num_key_heads: int  # linear_num_key_heads
    num_value_heads: int  # linear_num_value_heads
    key_head_dim: int  # linear_key_head_dim
    value_head_dim: int  # linear_value_head_dim
    conv_width: int  # linear_conv_kernel_dim
    rms_norm_eps: float

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.num_key_heads})")
        if self.conv_width < 2:
            raise ValueError(f"linear_conv_kernel_dim {self.conv_width}: at least 2")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # q, k and v go through the convolution together
        return 2 * self.key_dim + self.value_dim

    @property
    def channels_per_key_head(self) -> int:
        """A key head's convolution channels: its q, its k, its value heads' v."""
        return self.conv_dim // self.num_key_heads


def hybrid_fields(hf_config: Any, architecture: str) -> dict:
    """ModelConfig's fields of a Qwen3.5 (dense or MoE) or Qwen3-Next text config: which layers are linear, their
    shapes, the gated full attention's switches and the (1 + weight) norms."""
    c = hf_config
    kinds = list(getattr(c, "layer_types", None) or ())
    if len(kinds) != c.num_hidden_layers:
        raise ValueError(f"{architecture}: layer_types has {len(kinds)} entries for "
                         f"{c.num_hidden_layers} layers")
    if unknown := sorted(set(kinds) - set(_LAYER_KINDS)):
        raise ValueError(f"{architecture} with layer_types {unknown} is not supported "
                         f"({', '.join(_LAYER_KINDS)})")
    if getattr(c, "attention_bias", False):
        raise ValueError(f"{architecture} with attention_bias=True is not supported")
    linear = LinearAttentionConfig(
        hidden_size=c.hidden_size, num_key_heads=c.linear_num_key_heads,
        num_value_heads=c.linear_num_value_heads, key_head_dim=c.linear_key_head_dim,
        value_head_dim=c.linear_value_head_dim, conv_width=c.linear_conv_kernel_dim,
        rms_norm_eps=float(c.rms_norm_eps))
    return dict(linear_attention=linear,
                linear_layers=tuple(kind == "linear_attention" for kind in kinds),
                attention_output_gate=True, qk_norm=True, norm_offset=1.0)
