"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the attention of a decoder layer whose
cache holds one compressed row per token instead of per-head keys and values.

Per token, `kv_a_proj` makes a compressed KV (kv_lora_rank) and a key part shared by every head
(qk_rope_head_dim, RoPE'd); the cache keeps the normed compressed KV and the RoPE'd part, one
row of kv_lora_rank + qk_rope_head_dim (576 for V3: 57x smaller than its 128 heads' K and V).
Each head's key is `[W_UK c, k_rope]` and value `W_UV c` (`kv_b_proj` = [W_UK; W_UV] per head),
so attention runs in the latent space (the absorbed form): each head's no-RoPE query is taken
through W_UK (`q_latent = q_nope @ W_UK`), scored against the cached rows, and the weighted sum
of rows goes through W_UV, then `o_proj`
(pallas_kernels/ragged_paged_attention/reference.py, `mla_ragged_paged_attention`, the
specification; `Kernels.latent_attention` is the platform's kernel for it).

The queries: `q_proj`, or with a q_lora_rank `q_b_proj(q_a_norm(q_a_proj(x)))`. RoPE: DeepSeek
rotates interleaved pairs (x0, x1), (x2, x3)...; the rows of the RoPE'd part are stored
de-interleaved at load (evens, then odds: `interleaved_rope_rows`), after which the usual
rotate-half RoPE computes the same scores (the same permutation on query and key). The softmax
scale is (nope + rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where the RoPE is
scaled, as transformers' `yarn_apply_mscale`.

Weights (ours): `q_a_proj [hidden, q_lora]`, `q_a_norm`, `q_b_proj [q_lora, H, nope + rope]` (or
`q_proj [hidden, H, nope + rope]`), `kv_a_proj [hidden, kv_lora + rope]`, `kv_a_norm`,
`w_uk [H, nope, kv_lora]`, `w_uv [H, kv_lora, v]`, `o_proj [H, v, hidden]`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.model.fp8_kv_cache import is_fp8, quantize, rescaled
from xlaserve.model.layers import (Kernels, RMSNorm, apply_rope, init_weight,
                                   matmul_input_dtype, project)
from xlaserve.pallas_kernels.ragged_paged_attention.reference import merge_by_lse
from xlaserve.pallas_kernels.ragged_paged_attention.tree_tokens import tree_token_attention


# DeepSeek's q_a_layernorm and kv_a_layernorm take their RMSNorm's default epsilon, not the
# config's rms_norm_eps (DeepseekV3RMSNorm(q_lora_rank), in transformers and DeepSeek's code).
LORA_NORM_EPS = 1e-6


def interleaved_rope_rows(num_rows: int, rope_dim: int) -> np.ndarray:
    """The row order that de-interleaves the last `rope_dim` rows of each `num_rows` block:
    the RoPE'd part's even rows, then its odd ones."""
    nope = num_rows - rope_dim
    return np.concatenate([np.arange(nope), nope + np.arange(0, rope_dim, 2),
                           nope + np.arange(1, rope_dim, 2)])


class MLAttention(nnx.Module):
    def __init__(self, config, layer_index: int, dtype, rngs: nnx.Rngs):
        c, m = config, config.mla
        self.config = c
        # An FP8 cache's scale of the latent rows, keys and values both: the layer's k_scale
        # (fp8_kv_cache.py).
        self.latent_scale = c.kv_scales[layer_index][0] if c.kv_scales else 1.0
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.q_a_proj = nnx.Param(init_weight(rngs, (c.hidden_size, m.q_lora_rank), dtype))
            self.q_a_norm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = nnx.Param(init_weight(rngs, (m.q_lora_rank, c.num_heads, qk_dim), dtype))
        else:
            self.q_proj = nnx.Param(init_weight(rngs, (c.hidden_size, c.num_heads, qk_dim), dtype))
        self.kv_a_proj = nnx.Param(init_weight(rngs, (c.hidden_size, m.cache_width), dtype))
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.w_uk = nnx.Param(init_weight(
            rngs, (c.num_heads, m.qk_nope_head_dim, m.kv_lora_rank), dtype))
        self.w_uv = nnx.Param(init_weight(rngs, (c.num_heads, m.kv_lora_rank, m.v_head_dim), dtype))
        self.o_proj = nnx.Param(init_weight(rngs, (c.num_heads, m.v_head_dim, c.hidden_size), dtype))

    def input_matrix(self):
        """The first matrix the layer's input meets (its dtype is the input's)."""
        return self.kv_a_proj[...]

    def __call__(self, x, cos, sin, kv_cache, metadata, kernels: Kernels):
        m = self.config.mla
        if m.q_lora_rank:
            q_low = self.q_a_norm(project(x, self.q_a_proj[...], kernels))
            q = project(q_low.astype(matmul_input_dtype(self.q_b_proj[...])), self.q_b_proj[...],
                        kernels)
        else:
            q = project(x, self.q_proj[...], kernels)
        q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        compressed = project(x, self.kv_a_proj[...], kernels)  # [T, kv_lora + rope]
        kv = self.kv_a_norm(compressed[:, :m.kv_lora_rank])
        k_rope = apply_rope(compressed[:, None, m.kv_lora_rank:], cos, sin)[:, 0]
        w_uk = self.w_uk[...]
        q_latent = jnp.einsum("thn,hnr->thr", q_nope.astype(w_uk.dtype), w_uk,
                              preferred_element_type=jnp.float32)
        # The cache's dtype (the model's), or with an FP8 cache the model's for the queries
        # and the latent rows scaled into FP8 (fp8_kv_cache.py; the scale folds into the
        # softmax scale and the latent-space output).
        fp8, scale = is_fp8(kv_cache.dtype), self.latent_scale
        dtype = w_uk.dtype if fp8 else kv_cache.dtype
        q_rope = apply_rope(q_rope, cos, sin)
        query = jnp.concatenate([q_latent, q_rope], axis=-1).astype(dtype)
        latent = jnp.concatenate([kv, k_rope], axis=-1)
        latent = quantize(latent, scale, kv_cache.dtype) if fp8 else latent.astype(dtype)
        scale = scale if fp8 else 1.0
        w_uv = self.w_uv[...]
        attention_args = (query, latent, kv_cache, metadata.kv_lens, metadata.page_indices,
                          metadata.cu_q_lens, metadata.num_seqs)
        if 0 < kernels.mla_expanded_prefill_tokens <= x.shape[0] and \
                metadata.tree_masks is None:  # the bucket's size: static
            out, kv_cache = expanded_attention(
                q_nope, q_rope, attention_args, self.w_uk[...], w_uv, kernels,
                kv_lora_rank=m.kv_lora_rank, sm_scale=m.softmax_scale, latent_scale=scale)
        else:
            if metadata.tree_masks is not None:  # speculative tree rows: absorbed, masked
                out, kv_cache = tree_latent_attention(attention_args, metadata, kernels,
                                                      kv_lora_rank=m.kv_lora_rank,
                                                      sm_scale=m.softmax_scale * scale)
            else:
                out, kv_cache = kernels.latent_attention(
                    *attention_args, sm_scale=m.softmax_scale * scale, value_dim=m.kv_lora_rank)
            out = jnp.einsum("thr,hrv->thv", rescaled(out, scale).astype(w_uv.dtype), w_uv,
                             preferred_element_type=jnp.float32)
        out = project(out.reshape(x.shape[0], -1).astype(matmul_input_dtype(self.o_proj[...])),
                      self.o_proj[...], kernels)
        return out, kv_cache


def tree_latent_attention(attention_args, metadata, kernels: Kernels, *, kv_lora_rank: int,
                          sm_scale: float):
    """Speculative tree rows (pallas_kernels/ragged_paged_attention/tree_tokens.py) in the
    absorbed form: the latent kernel's prefix part merged with each token's attention to the
    new latent rows its tree mask names (every head's key the row, its value the row's first
    kv_lora_rank entries). Returns (out [T, H, kv_lora_rank] float32, kv_cache)."""
    out_prefix, lse_prefix, kv_cache = kernels.latent_prefix_attention(
        *attention_args, sm_scale=sm_scale, value_dim=kv_lora_rank)
    query, latent = attention_args[:2]
    rows = latent[:, None]  # one kv head: every query head reads it
    out_new, lse_new = tree_token_attention(
        query, rows, rows[..., :kv_lora_rank], metadata.tree_masks, metadata.cu_q_lens,
        metadata.num_seqs, sm_scale=sm_scale, width=metadata.tree_width)
    return merge_by_lse(out_prefix, lse_prefix, out_new, lse_new), kv_cache


def expanded_attention(q_nope, q_rope, attention_args, w_uk, w_uv, kernels: Kernels, *,
                       kv_lora_rank: int, sm_scale: float, latent_scale: float = 1.0):
    """The expanded form (SGLang's and vLLM's for prefills): each token's attention to its
    sequence's cached prefix in the absorbed form (the latent kernel with prefix_only, which also
    writes the new rows), and to the step's new tokens with per-head keys [c W_UK, k_rope] (nope +
    rope wide) and values c W_UV (v_head_dim): fewer FLOPs per (query, key) pair than the
    absorbed form's kv_lora + rope and kv_lora. The two are merged by their log-sum-exp.
    q_nope [T, H, nope], q_rope [T, H, rope] (RoPE'd); `attention_args` the latent kernel's, its
    second the new rows [T, kv_lora + rope] as the cache holds them (an FP8 cache's: scaled by
    1 / `latent_scale`). Returns (out [T, H, v_head_dim] float32, kv_cache)."""
    out_prefix, lse_prefix, kv_cache = kernels.latent_prefix_attention(
        *attention_args, sm_scale=sm_scale * latent_scale, value_dim=kv_lora_rank)
    out_prefix = jnp.einsum("thr,hrv->thv",
                            rescaled(out_prefix, latent_scale).astype(w_uv.dtype), w_uv,
                            preferred_element_type=jnp.float32)
    query, latent = attention_args[:2]
    dtype = query.dtype
    if is_fp8(latent.dtype):  # the rows as the cache holds them, as the absorbed form reads them
        latent = (latent.astype(jnp.float32) * latent_scale).astype(dtype)
    compressed, k_rope = latent[:, :kv_lora_rank], latent[:, kv_lora_rank:]
    keys = jnp.einsum("tr,hnr->thn", compressed.astype(w_uk.dtype), w_uk,
                      preferred_element_type=jnp.float32).astype(dtype)
    keys = jnp.concatenate([keys, jnp.broadcast_to(
        k_rope[:, None], keys.shape[:2] + k_rope.shape[-1:])], axis=-1)
    values = jnp.einsum("tr,hrv->thv", compressed.astype(w_uv.dtype), w_uv,
                        preferred_element_type=jnp.float32).astype(dtype)
    query = jnp.concatenate([q_nope.astype(dtype), q_rope.astype(dtype)], axis=-1)
    cu_q_lens, num_seqs = attention_args[5:]
    out_new, lse_new = kernels.new_token_attention(query, keys, values, cu_q_lens, num_seqs,
                                                   sm_scale=sm_scale)
    return merge_by_lse(out_prefix, lse_prefix, out_new, lse_new), kv_cache


def mla_weights(fetch, c, attn: str, path: tuple):
    """(path, array) of one layer's MLA weights from a DeepSeek checkpoint: `fetch(name, shape)`
    reads a tensor [out, in]; `attn` is its "model.layers.i.self_attn." prefix."""
    m, hidden, heads = c.mla, c.hidden_size, c.num_heads
    qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
    rope_rows = (interleaved_rope_rows(qk_dim, m.qk_rope_head_dim) if m.rope_interleave
                 else np.arange(qk_dim))

    def query_rows(matrix, inputs):  # [heads * qk, in] -> [in, heads, qk], RoPE rows de-interleaved
        return matrix.reshape(heads, qk_dim, inputs)[:, rope_rows].transpose(2, 0, 1)

    if m.q_lora_rank:
        yield path + ("q_a_proj",), fetch(attn + "q_a_proj.weight", (m.q_lora_rank, hidden)).T
        yield path + ("q_a_norm", "scale"), fetch(attn + "q_a_layernorm.weight", (m.q_lora_rank,))
        yield path + ("q_b_proj",), query_rows(
            fetch(attn + "q_b_proj.weight", (heads * qk_dim, m.q_lora_rank)), m.q_lora_rank)
    else:
        yield path + ("q_proj",), query_rows(
            fetch(attn + "q_proj.weight", (heads * qk_dim, hidden)), hidden)
    kv_a = fetch(attn + "kv_a_proj_with_mqa.weight", (m.cache_width, hidden))
    if m.rope_interleave:
        kv_a = kv_a[interleaved_rope_rows(m.cache_width, m.qk_rope_head_dim)]
    yield path + ("kv_a_proj",), kv_a.T
    yield path + ("kv_a_norm", "scale"), fetch(attn + "kv_a_layernorm.weight", (m.kv_lora_rank,))
    kv_b = fetch(attn + "kv_b_proj.weight",
                 (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    kv_b = kv_b.reshape(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    yield path + ("w_uk",), kv_b[:, :m.qk_nope_head_dim]
    yield path + ("w_uv",), kv_b[:, m.qk_nope_head_dim:].transpose(0, 2, 1)
    o = fetch(attn + "o_proj.weight", (hidden, heads * m.v_head_dim))
    yield path + ("o_proj",), o.T.reshape(heads, m.v_head_dim, hidden)
