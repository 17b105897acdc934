"""Llama 4's text model (Llama4ForCausalLM, transformers' Llama4TextConfig): the fields
ModelConfig.from_hf adds to a Llama-style decoder for it, and what model/transformer.py does not
run refused in one line.

What differs from Llama 3 (transformers' modeling_llama4.py, the tests' oracle):
- mixture-of-experts layers by `moe_layers` (from `interleave_moe_layer_step`), the others dense
  MLPs of `intermediate_size_mlp`; an MoE layer is an ungated shared expert every token runs plus
  `num_local_experts` routed experts (both `intermediate_size` wide), the router's top logit
  through a sigmoid (routing.py's "sigmoid" scoring, not renormalized), and that score scales
  the expert's input, not its output (`ModelConfig.expert_input_scaled`: SwiGLU is not linear,
  so the two differ);
- RoPE layers and NoPE layers by `no_rope_layers` (0: no RoPE; `ModelConfig.nope_layers`). The
  RoPE layers L2-normalize q and k after RoPE (`use_qk_norm`: an RMS norm without weights, the
  same before RoPE, which keeps each pair's length) and attend in chunks of
  `attention_chunk_size` positions (`layer_types` "chunked_attention": a query at q sees the keys
  k <= q with k // C == q // C; `ModelConfig.attention_chunks`, which the attention kernels mask
  by and which bounds what a decode reads); the NoPE layers attend to everything, their queries
  scaled by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1 (`attn_temperature_tuning`);
- RoPE rotates interleaved pairs (x0, x1), (x2, x3)... (complex multiplication), where ours
  rotates halves: q's and k's rows are stored de-interleaved at load (`rope_interleaved`, the
  permutation DeepSeek's latent attention uses), which leaves every dot product as it was.

Llama4ForConditionalGeneration (Scout, Maverick): that text model in its `text_config`, beside
its vision encoder and projector (llama4_vision_config.py).
"""
from __future__ import annotations

from typing import Any

LLAMA4_ARCHITECTURES = ("Llama4ForCausalLM",)
# It and its checkpoints with images (Llama-4-Scout-17B-16E, Maverick: their text model is a
# Llama4ForCausalLM's, encoder_config.images_config) name their feed-forward blocks
# `feed_forward.*` (weights/param_layout.py).
LLAMA4_NAMES = (*LLAMA4_ARCHITECTURES, "Llama4ForConditionalGeneration")
_LAYER_TYPES = ("chunked_attention", "full_attention")


def llama4_fields(hf_config: Any, architecture: str) -> dict:
    """ModelConfig's fields of a Llama 4 text config (replacing the Llama ones where they
    differ); routing other than top 1 and unknown layer types refused."""
    c = hf_config
    layers = c.num_hidden_layers
    if c.num_experts_per_tok != 1:
        raise ValueError(f"{architecture} with num_experts_per_tok={c.num_experts_per_tok} is not "
                         "supported (Llama 4's configs route each token to 1 expert)")
    kinds = set(getattr(c, "layer_types", None) or ()) - set(_LAYER_TYPES)
    if kinds:
        raise ValueError(f"{architecture} with layer_types {sorted(kinds)} is not supported "
                         f"({', '.join(_LAYER_TYPES)})")
    no_rope = list(c.no_rope_layers)  # transformers' __post_init__ fills it: 1 is RoPE, 0 NoPE
    moe = set(c.moe_layers)
    chunk = getattr(c, "attention_chunk_size", None)
    layer_types = list(c.layer_types or ("full_attention",) * layers)
    temperature = (float(c.floor_scale), float(c.attn_scale)) \
        if c.attn_temperature_tuning and not all(no_rope[:layers]) else None
    return dict(
        intermediate_size=c.intermediate_size_mlp,
        num_experts=c.num_local_experts, num_experts_per_tok=1,
        moe_intermediate_size=c.intermediate_size, norm_topk_prob=False,
        shared_expert_intermediate_size=c.intermediate_size, shared_expert_gate=False,
        router_scoring="sigmoid", expert_input_scaled=True,
        moe_layers=tuple(i in moe for i in range(layers)),
        qk_norm=False, qk_l2_norm=bool(c.use_qk_norm),
        nope_layers=tuple(not no_rope[i] for i in range(layers)),
        attention_temperature=temperature, rope_interleaved=True,
        attention_chunks=tuple(int(chunk) if kind == "chunked_attention" and chunk else None
                               for kind in layer_types[:layers]))

