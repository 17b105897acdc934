"""Attention for speculative tree rows: a step whose sequences each run at most `width` new
tokens, where a token sees the new tokens of its sequence that its mask names, not every earlier
one (runtime/scheduler/speculation.py drafts trees with --speculative-eagle-topk > 1).

A drafted tree is verified as one row of the ragged batch: its root (the request's last token)
first, then its nodes, each after its parent. Node i sits at position `root + depth(i)` for RoPE
but is written at cache slot `root + i`, so the kernels' causal rule (token i sees the slots up
to its own) would let a node see its cousins. The attention is therefore split in two:
- the prefix, every token against its sequence's keys from before the step: the platform's
  kernel with `prefix_only` (its out and log-sum-exp);
- the new tokens, `tree_token_attention` here: token t against the `width` new tokens from its
  sequence's start, masked by `tree_masks[t]` (bit j: the sequence's j-th new token, its
  ancestors and itself), a dense [T, width] score matrix in jnp (width <= 32, the mask's bits);
and `reference.merge_by_lse` joins the two into the softmax over both. A plain decoding row
(mask 1) and a chain (token j's mask `2^(j+1) - 1`) are trees too, so one step program serves
every row of such a step; prompt chunks never run in it (Speculator.drafts drafts only in
steps without one).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.pallas_kernels.ragged_paged_attention.new_tokens import segment_ids
from xlaserve.pallas_kernels.ragged_paged_attention.reference import merge_by_lse, widened

MAX_TREE_TOKENS = 32  # tokens of a tree row at most: the bits of an int32 mask


def tree_token_attention(q, k, v, tree_masks, cu_q_lens, num_seqs, *, sm_scale: float,
                         width: int, soft_cap=None):
    """(out [T, Hq, Dv] float32, lse [T, Hq] float32) of each token against the new tokens of its
    sequence its mask names. q [T, Hq, D]; k [T, Hkv, D]; v [T, Hkv, Dv] (Hq a multiple of
    Hkv); tree_masks i32[T]; padding tokens (mask 0) have no key: lse -inf, out 0."""
    if not 0 < width <= MAX_TREE_TOKENS:
        raise ValueError(f"a tree row holds 1..{MAX_TREE_TOKENS} tokens, not {width}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    max_seqs = cu_q_lens.shape[0] - 1
    seq = segment_ids(cu_q_lens, num_seqs, num_tokens)
    start = jnp.append(cu_q_lens[:-1], num_tokens)[seq]  # padding: past the end
    offsets = jnp.arange(width, dtype=jnp.int32)
    keys = start[:, None] + offsets[None, :]  # [T, width]
    seen = ((tree_masks[:, None] >> offsets[None, :]) & 1).astype(jnp.bool_)
    seen &= (keys < num_tokens) & (seq < max_seqs)[:, None]
    keys = jnp.minimum(keys, num_tokens - 1)
    k_rows = widened(k[keys], q.dtype)  # [T, width, Hkv, D]; an FP8 cache's rows widened
    # Unseen rows may be another sequence's or padding (NaN there): p * NaN is NaN even at p=0.
    v_rows = jnp.where(seen[:, :, None, None], widened(v[keys], q.dtype), 0)
    q = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,twhd->thgw", q, k_rows,
                        preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # -inf where nothing is seen
    probs = jnp.where(seen[:, None, None, :], jnp.exp(scores - jnp.where(
        jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("thgw,twhd->thgd", probs.astype(v_rows.dtype), v_rows,
                     preferred_element_type=jnp.float32)
    return (out.reshape(num_tokens, num_q_heads, v.shape[-1]),
            lse.reshape(num_tokens, num_q_heads))


def tree_attention(attention, q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                   tree_masks, *, sm_scale, width: int, soft_cap=None, sinks=None, **options):
    """`attention` (a kernel of `reference.ragged_paged_attention`'s signature that takes
    `prefix_only`) over each sequence's prefix, merged with `tree_token_attention` over its new
    tokens; returns (out [T, Hq, D] in q's dtype, kv_cache), the new K/V written by the kernel
    at slots [kv_len - q_len, kv_len) as always."""
    out_prefix, lse_prefix, kv_cache = attention(
        q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
        soft_cap=soft_cap, sinks=sinks, prefix_only=True, **options)
    out_new, lse_new = tree_token_attention(q, k, v, tree_masks, cu_q_lens, num_seqs,
                                            sm_scale=sm_scale, width=width, soft_cap=soft_cap)
    return merge_by_lse(out_prefix, lse_prefix, out_new, lse_new).astype(q.dtype), kv_cache
