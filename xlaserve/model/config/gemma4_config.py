"""Gemma 4's text model (Gemma4ForCausalLM, transformers' Gemma4TextConfig): the fields
ModelConfig.from_hf adds to a Llama-style decoder for it, and what model/transformer.py does not
run refused in one line.

What it shares with Gemma 3 (gemma_config.py): sliding and full layers by `layer_types`, each
kind with its own RoPE (the full layers' "proportional" RoPE rotating the first
`partial_rotary_factor` of each head's pairs, rope_config.py), q/k norms, the norms around both
sublayers, embeddings times sqrt(hidden), GeGLU, the tied head. What differs (transformers'
modeling_gemma4.py, the tests' oracle): the RMSNorms multiply by their weight as stored (no
1 + weight); values get a weightless RMS norm (`ModelConfig.value_norm`); the softmax is unscaled
(scale 1.0: the q/k norms set the logits' size); each layer's output, residual included, is
multiplied by its `layer_scalar` (a weight, `ModelConfig.layer_scalars`); the logits are
soft-capped, tanh(l / c) * c (`final_logit_softcapping`); with `attention_k_eq_v` the full layers
have no v_proj, their values the keys' projection (before k's norm and RoPE), read at load as
v_proj = k_proj (`ModelConfig.value_is_key`).

Per-layer embeddings (hidden_size_per_layer_input: `ModelConfig.per_layer_input_size`,
model/per_layer_inputs.py); the last num_kv_shared_layers layers reading the cache of an earlier
layer of their kind, with no cache of their own (`ModelConfig.kv_source_layers`), their MLPs twice
as wide with use_double_wide_mlp (`ModelConfig.layer_intermediate`). The MoE block
(enable_moe_block: every layer's experts beside its dense MLP) is `ModelConfig.experts_beside_mlp`
(model/moe.ExpertsBesideMlp). Refused in one line, naming the field: bidirectional attention
(use_bidirectional_attention "all"; "vision" only concerns images), a
per-layer-input vocabulary other than the model's. The full layers' own head size and KV heads (global_head_dim,
num_global_key_value_heads) are `ModelConfig.layer_heads`: each layer's cache its own shape.
"""
from __future__ import annotations

from typing import Any

GEMMA4_ARCHITECTURES = ("Gemma4ForCausalLM",)
_LAYER_TYPES = ("sliding_attention", "full_attention")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")


def gemma4_fields(hf_config: Any, architecture: str) -> dict:
    """ModelConfig's Gemma 4 fields of a Gemma 4 text config; what is not run refused."""
    c = hf_config
    per_layer_input = getattr(c, "hidden_size_per_layer_input", 0) or 0
    if per_layer_input and c.vocab_size_per_layer_input != c.vocab_size:
        raise ValueError(f"Gemma 4: vocab_size_per_layer_input={c.vocab_size_per_layer_input} "
                         f"other than vocab_size={c.vocab_size} is not supported")
    # "vision": image tokens see their whole image (gemma4_vision_config.py); text is causal.
    if getattr(c, "use_bidirectional_attention", None) not in (None, "vision"):
        raise ValueError(f"Gemma 4: use_bidirectional_attention={c.use_bidirectional_attention!r}"
                         " is not supported")
    activation = getattr(c, "hidden_activation", None)
    if activation not in _GELU_TANH:
        raise ValueError(f"Gemma 4: hidden_activation {activation!r} is not supported "
                         f"({', '.join(_GELU_TANH)})")
    layer_types = list(c.layer_types)[:c.num_hidden_layers]
    kinds = set(layer_types) - set(_LAYER_TYPES)
    if kinds:
        raise ValueError(f"Gemma 4: layer_types {sorted(kinds)} are not supported "
                         f"({', '.join(_LAYER_TYPES)})")
    # transformers' per-layer overrides (the full layers' global_head_dim and, with
    # attention_k_eq_v, num_global_key_value_heads): read per layer, as c.head_dim is unreadable
    # where they differ.
    layers = c.per_layer_config
    layer_heads = tuple((layers[i].num_key_value_heads, layers[i].head_dim)
                        for i in range(c.num_hidden_layers))
    cap = getattr(c, "final_logit_softcapping", None)
    if cap is not None and cap <= 0:
        raise ValueError(f"Gemma 4: final_logit_softcapping={cap} is not supported (> 0 or None)")
    k_eq_v = bool(getattr(c, "attention_k_eq_v", False))
    return dict(
        qk_norm=True, value_norm=True, norm_offset=0.0, sandwich_norms=True,
        embedding_multiplier=c.hidden_size**0.5, attention_scale=1.0, activation="gelu_tanh",
        layer_scalars=True, final_logit_softcapping=None if cap is None else float(cap),
        value_is_key=tuple(k_eq_v and kind == "full_attention" for kind in layer_types),
        layer_heads=layer_heads, per_layer_input_size=per_layer_input,
        **_moe_block(c), **_kv_sharing(c, layer_types))


def _kv_sharing(c: Any, layer_types: list[str]) -> dict:
    """The last num_kv_shared_layers layers read the cache of the last earlier layer of their
    kind (transformers' kv_sharing_modes "reuse" and "store"), and with use_double_wide_mlp
    have an MLP twice as wide."""
    shared = getattr(c, "num_kv_shared_layers", 0) or 0
    if not shared:
        return {}
    n = c.num_hidden_layers
    first = n - shared
    sources = list(range(first))
    for i in range(first, n):
        writers = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not writers:
            raise ValueError(f"Gemma 4: num_kv_shared_layers={shared} leaves no earlier "
                             f"{layer_types[i]} layer for layer {i} to read")
        sources.append(writers[-1])
    fields = dict(kv_source_layers=tuple(sources))
    if getattr(c, "use_double_wide_mlp", False):
        fields["layer_intermediate"] = tuple(c.intermediate_size * (2 if i >= first else 1)
                                             for i in range(n))
    return fields


def _moe_block(c: Any) -> dict:
    """The MoE block's fields (enable_moe_block: every layer's experts beside its MLP)."""
    if not getattr(c, "enable_moe_block", False):
        return {}
    if not c.num_experts or not 0 < (c.top_k_experts or 0) <= c.num_experts:
        raise ValueError(f"Gemma 4: enable_moe_block with num_experts={c.num_experts} and "
                         f"top_k_experts={c.top_k_experts} is not supported")
    return dict(num_experts=c.num_experts, num_experts_per_tok=c.top_k_experts,
                moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=True,
                moe_layers=(False,) * c.num_hidden_layers, experts_beside_mlp=True)
