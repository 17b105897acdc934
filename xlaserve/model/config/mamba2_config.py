"""NVIDIA's Nemotron-H (`NemotronHForCausalLM`, issue 76): a hybrid of Mamba-2 layers
(model/mamba2.py), a few full-attention layers without positions (NoPE), and ReLU^2 MLPs.

Its checkpoint is a list of single-mixer blocks, `x = x + mixer(norm(x))`, each one of
`layers_block_type` (`hybrid_override_pattern`: M Mamba-2, * attention, - MLP, E experts). Our
decoder layer is a mixer then a feed-forward (model/transformer.DecoderLayer), so each mixer block
(M or *) is paired with the MLP or experts block right after it: the layer's input norm is the
mixer block's norm, its post-attention norm the feed-forward block's. A mixer block with no
feed-forward after it is a layer without one (model/layer_parts.NoMLP). `nemotron_blocks` keeps,
per layer, the checkpoint's block indices (weights/linear_attention_layout.py reads them). The
experts (E, model/moe.py) have no gate (ReLU^2 of up), DeepSeek-V3's router (sigmoid scores,
groups scored by their best two, a correction bias for the choice) and an ungated ReLU^2 shared
expert. What the code does not run is refused in one line: the experts' latent projection
(moe_latent_size), biases, sliding windows, a feed-forward block with no mixer before it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from xlaserve.model.config.rope_config import rope_from_hf

NEMOTRON_H_ARCHITECTURES = ("NemotronHForCausalLM",)
MIXERS, FEED_FORWARDS = ("linear_attention", "full_attention"), ("mlp", "moe")
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """A Mamba-2 mixer's shapes (transformers' NemotronHConfig fields in comments)."""

    hidden_size: int
    num_heads: int  # mamba_num_heads
    head_dim: int  # mamba_head_dim
    state_size: int  # ssm_state_size
    num_groups: int  # n_groups: B and C are per group, each over num_heads / num_groups heads
    conv_width: int  # conv_kernel
    conv_bias: bool  # use_conv_bias
    chunk_size: int  # chunk_size (what a chunked scan would take; the reference is recurrent)
    # dt clamped into it after softplus, at every token (the Mamba-2 reference's dt_limit).
    # transformers' NemotronH clamps a prompt's dt to (time_step_min, inf) and a decoded
    # token's not at all; the two differ only where softplus(dt + dt_bias) < time_step_min.
    time_step_limit: tuple[float, float]
    rms_norm_eps: float  # layer_norm_epsilon (the gated norm's)

    def __post_init__(self):
        if self.num_heads % self.num_groups:
            raise ValueError(f"n_groups ({self.num_groups}) must divide mamba_num_heads "
                             f"({self.num_heads})")
        if self.conv_width < 2:
            raise ValueError(f"conv_kernel {self.conv_width}: at least 2")

    @property
    def inner_size(self) -> int:  # the heads' channels: x's, z's, the gated norm's
        return self.num_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    @property
    def channels_per_group(self) -> int:
        """A group's convolution channels: its heads' x, then its B and C."""
        return self.heads_per_group * self.head_dim + 2 * self.state_size

    @property
    def conv_dim(self) -> int:  # x, B and C go through the convolution together
        return self.inner_size + 2 * self.num_groups * self.state_size


def nemotron_h_fields(c: Any, architecture: str) -> dict:
    """ModelConfig's fields of a NemotronHConfig; ValueError naming what is not run."""
    kinds = list(getattr(c, "layers_block_type", None) or ())
    if not kinds:
        pattern = getattr(c, "hybrid_override_pattern", "") or ""
        kinds = [_PATTERN.get(ch, repr(ch)) for ch in pattern]
    for flag, value in (("use_bias", c.use_bias), ("mlp_bias", c.mlp_bias),
                        ("attention_bias", c.attention_bias)):
        if value:
            raise ValueError(f"{architecture} with {flag}=True is not supported")
    if "moe" in kinds and getattr(c, "moe_latent_size", None) is not None:
        raise ValueError(f"{architecture} with moe_latent_size {c.moe_latent_size} is not "
                         "supported (the experts' latent projection is not built)")
    if unknown := sorted(set(kinds) - set(MIXERS) - set(FEED_FORWARDS)):
        raise ValueError(f"{architecture} with layers_block_type {unknown} is not supported")
    for name, value, wanted in (("mlp_hidden_act", c.mlp_hidden_act, "relu2"),
                                ("mamba_hidden_act", c.mamba_hidden_act, "silu")):
        if value != wanted:
            raise ValueError(f"{architecture} with {name} {value!r} is not supported ({wanted})")
    if getattr(c, "sliding_window", None):
        raise ValueError(f"{architecture} with sliding_window {c.sliding_window} is not supported")
    blocks = _paired_blocks(kinds, architecture)
    mamba2 = Mamba2Config(
        hidden_size=c.hidden_size, num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim,
        state_size=c.ssm_state_size, num_groups=c.n_groups, conv_width=c.conv_kernel,
        conv_bias=bool(c.use_conv_bias), chunk_size=c.chunk_size,
        time_step_limit=tuple(float(x) for x in c.time_step_limit),
        rms_norm_eps=float(c.layer_norm_epsilon))
    eos = c.eos_token_id
    layers = len(blocks)
    return dict(
        architecture=architecture, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads or
        c.num_attention_heads, head_dim=c.head_dim or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=float(c.layer_norm_epsilon), rope=rope_from_hf(c),
        max_position_embeddings=int(c.max_position_embeddings),
        tie_word_embeddings=bool(c.tie_word_embeddings), bos_token_id=c.bos_token_id,
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else
        (() if eos is None else (eos,)),
        nope_layers=(True,) * layers,  # its attention has no positions
        activation="relu2", mamba2=mamba2, nemotron_blocks=blocks,
        linear_layers=tuple(kinds[mixer] == "linear_attention" for mixer, _ in blocks),
        **_experts(c, [ffn >= 0 and kinds[ffn] == "moe" for _, ffn in blocks]))


def _experts(c: Any, moe_layers: list[bool]) -> dict:
    """The experts' fields (none without E blocks): transformers' NemotronHTopkRouter is
    DeepSeek-V3's (the top-2 sum scores each group, whatever n_group), its shared expert one
    ungated MLP of moe_shared_expert_intermediate_size."""
    if not any(moe_layers):
        return {}
    return dict(num_experts=c.n_routed_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size,
                norm_topk_prob=bool(c.norm_topk_prob),
                shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
                shared_expert_gate=False, router_scoring="sigmoid", router_groups=c.n_group,
                router_topk_groups=c.topk_group, router_group_score="top2_sum",
                router_correction_bias=True,
                routed_scaling_factor=float(c.routed_scaling_factor),
                moe_layers=tuple(moe_layers))


def _paired_blocks(kinds: list[str], architecture: str) -> tuple[tuple[int, int], ...]:
    """(mixer block, the MLP block after it or -1) per decoder layer."""
    blocks, i = [], 0
    while i < len(kinds):
        if kinds[i] not in MIXERS:
            raise ValueError(f"{architecture}: block {i} ({kinds[i]}) has no mixer block before "
                             "it (a feed-forward pairs with the mixer it follows)")
        follows = i + 1 < len(kinds) and kinds[i + 1] in FEED_FORWARDS
        blocks.append((i, i + 1 if follows else -1))
        i += 2 if follows else 1
    return tuple(blocks)
