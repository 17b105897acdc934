"""Gemma 3's decoder (Gemma3ForCausalLM, transformers' Gemma3TextConfig): the fields
ModelConfig.from_hf adds to a Llama-style decoder for it, and what model/transformer.py does not
run refused in one line.

What differs from Llama (transformers' modeling_gemma3.py): sliding-window and full layers by
`layer_types` (the window by `sliding_window`, read with every family's in model_config.py), each
kind with its own RoPE (`rope_parameters` keyed by layer type: rope_config.rope_from_hf, the local
one `ModelConfig.local_rope`); RMSNorms multiplying by 1 + weight in float32, per-head q and k
norms, and norms on attention's and the MLP's outputs before each residual add; the token
embeddings times sqrt(hidden_size) in the model dtype; the softmax scaled by
query_pre_attn_scalar ** -0.5; a GELU (tanh) gated MLP; the LM head tied. The model's part:
model/transformer.py.

Gemma3ForConditionalGeneration (gemma-3-4b-it, 12b, 27b): that text model in its `text_config`
(`image_checkpoint_text`), beside its SigLIP tower and projector (siglip_config.py), whose image
tokens attend to their whole image (pallas_kernels/ragged_paged_attention/image_spans.py).
"""
from __future__ import annotations

from typing import Any


GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM",)
# transformers' names of the tanh-approximated GELU (ACT2FN: both are the same formula).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")


def gemma3_fields(hf_config: Any, architecture: str) -> dict:
    """ModelConfig's Gemma fields of a Gemma 3 text config; logit soft-capping, bidirectional
    attention (EmbeddingGemma) and other activations or layer types refused."""
    c = hf_config
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, name, None) is not None:
            raise ValueError(f"{architecture} with {name}={getattr(c, name)} is not supported "
                             "(Gemma 3's configs set none)")
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError(f"{architecture} with use_bidirectional_attention (EmbeddingGemma) is "
                         "not supported")
    activation = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
    if activation not in _GELU_TANH:
        raise ValueError(f"{architecture} with hidden_activation {activation!r} is not supported "
                         f"({', '.join(_GELU_TANH)})")
    kinds = set(getattr(c, "layer_types", None) or ()) - {"sliding_attention", "full_attention"}
    if kinds:
        raise ValueError(f"{architecture} with layer_types {sorted(kinds)} is not supported "
                         "(sliding_attention, full_attention)")
    return dict(norm_offset=1.0, sandwich_norms=True, embedding_multiplier=c.hidden_size**0.5,
                attention_scale=float(c.query_pre_attn_scalar) ** -0.5, activation="gelu_tanh")


def image_checkpoint_text(hf_config: Any, architecture: str) -> tuple[Any, dict]:
    """An image checkpoint's text config (Gemma3ForConditionalGeneration's,
    Llama4ForConditionalGeneration's), and the ModelConfig fields its top level sets: the LM head
    tied or not and the end-of-sequence ids (gemma-3-4b-it's [1, 106]) as the checkpoint was
    saved with them."""
    text = getattr(hf_config, "text_config", None)
    if text is None:
        raise ValueError(f"{architecture}: the config has no text_config")
    fields = dict(architecture=architecture,
                  tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)))
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is not None:
        fields["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return text, fields
