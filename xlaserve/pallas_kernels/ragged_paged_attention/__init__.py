"""Ragged paged attention: the pure-jnp specification (reference.py) and its CPU (C++), TPU and GPU
(Pallas) kernels, one picked for the platform by `get_attention_fn`; multi-head latent
attention's absorbed and expanded forms, and `merge_by_lse` of their halves; speculative tree
rows' attention (`tree_attention`); Gemma 3's image tokens', each over its whole image
(`image_span_attention`, image_spans.py); the new tokens' attention among themselves, causal or
not (an encoder's: new_tokens.py)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "check_shapes": "api", "default_page_size": "api", "get_attention_fn": "api",
    "get_expanded_prefill_fns": "api", "get_latent_attention_fn": "api",
    "fixed_work_items": "api",
    "merge_by_lse": "reference", "mla_ragged_paged_attention": "reference",
    "reference_new_token_attention": "new_tokens", "bidirectional_cpu": "bidirectional_cpu",
    "tree_attention": "tree_tokens", "tree_token_attention": "tree_tokens",
    "ImageSpans": "image_spans", "image_spans": "image_spans",
    "image_span_attention": "image_spans",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
