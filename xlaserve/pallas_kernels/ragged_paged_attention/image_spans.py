"""Attention for Gemma 3's image tokens: each sees every token of its own image, later ones too,
and the rest causally (transformers' `token_type_ids` mask: causal OR same image; in a sliding
layer AND the window, which from the query's own position only bounds the keys before it), so
an image token at position p of an image [s, e) attends to the keys [first_key(p), e).

A step's images are spans of `tokens_per_image` rows each, all of an image in one step (the
scheduler never cuts one, and the prefix cache never ends a match inside one:
runtime/scheduler/request.py, `whole_span_end`). The causal kernel runs every row as always;
the image rows' outputs are then replaced by two parts merged by log-sum-exp
(`reference.merge_by_lse`), as speculative tree rows' are (tree_tokens.py):
- the keys before the image: the platform's kernel with `prefix_only` over a batch of the
  images alone: image j is a sequence whose new tokens are its L rows and whose kv_len is its
  end e, so its rows sit at their own positions (the window from there) and its prefix is
  [0, s). The kernel writes the image's K/V at [s, e) again: the values the causal call wrote.
- the image's own keys: a dense [L, L] score block per image and head (the window too),
  in jnp, one image at a time for as many as the step has (a loop of dynamic length: a
  step without images does none).
Why not a per-row key limit in the four kernels: this reuses `prefix_only`, which every kernel
has and is tested on, at the cost of the image rows' prefix read twice (their causal outputs
are thrown away), which is small beside the step (measured: docs/server.md, Gemma 3).

The images are found on the device: their rows' ids are negative, one value per image of the
step (runtime/executor/image_rows.add_image_rows), so a span opens where a row's id is
negative and differs from the row before's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from xlaserve.pallas_kernels.ragged_paged_attention.reference import (merge_by_lse,
                                                                       searchsorted_right, widened)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ImageSpans:
    """A step's images as a batch of their own for the kernel: N = tokens // L slots."""

    rows: jax.Array  # i32[N, L]: each image's rows of the step; T (none) for slots past the last
    kv_lens: jax.Array  # i32[N]: each image's end position (its sequence's kv_len there), 0 past
    page_indices: jax.Array  # i32[N, pages]: its sequence's pages
    cu_q_lens: jax.Array  # i32[N + 1]: image j's rows at [j L, (j + 1) L) of the gathered batch
    num_images: jax.Array  # i32[1]


def image_spans(input_ids, positions, cu_q_lens, page_indices,
                tokens_per_image: int) -> ImageSpans | None:
    """The step's images (module docstring): `input_ids` i32[T] with negative ids on image rows,
    `positions` i32[T], and the step's cu_q_lens and page table. None where the step is
    shorter than an image (a decode bucket: its program has no image part)."""
    tokens, length = input_ids.shape[0], tokens_per_image
    slots = tokens // length
    if slots == 0:
        return None
    before = jnp.concatenate([jnp.zeros((1,), input_ids.dtype), input_ids[:-1]])
    opens = (input_ids < 0) & (input_ids != before)
    (starts,) = jnp.nonzero(opens, size=slots, fill_value=tokens)
    live = starts < tokens
    count = live.sum(dtype=jnp.int32)
    first = jnp.minimum(starts, tokens - 1)
    seq = jnp.minimum(searchsorted_right(cu_q_lens[1:], first), page_indices.shape[0] - 1)
    rows = jnp.where(live[:, None], starts[:, None] + jnp.arange(length), tokens)
    kv_lens = jnp.where(live, positions[first] + length, 0)
    return ImageSpans(rows=rows.astype(jnp.int32), kv_lens=kv_lens.astype(jnp.int32),
                      page_indices=page_indices[seq],
                      cu_q_lens=(jnp.minimum(jnp.arange(slots + 1), count) * length
                                 ).astype(jnp.int32),
                      num_images=count[None])


def image_span_attention(attention, q, k, v, kv_cache, out, spans: ImageSpans, *, sm_scale,
                         sliding_window=None, soft_cap=None, sinks=None):
    """`out` (the causal kernel's [T, Hq, D] for q [T, Hq, D], k, v [T, Hkv, D]) with its image
    rows' attention over their whole image (module docstring), and the kv_cache the kernel
    (`attention`, reference.ragged_paged_attention's signature with `prefix_only`) returns."""
    num_tokens = q.shape[0]
    slots, length = spans.rows.shape
    rows = spans.rows.reshape(-1)
    taken = jnp.minimum(rows, num_tokens - 1)
    q_img, k_img, v_img = q[taken], k[taken], v[taken]
    out_prefix, lse_prefix, kv_cache = attention(
        q_img, k_img, v_img, kv_cache, spans.kv_lens, spans.page_indices, spans.cu_q_lens,
        spans.num_images, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        sinks=sinks, prefix_only=True)
    out_image, lse_image = _within_images(q_img, k_img, v_img, spans.num_images[0], slots,
                                          sm_scale=sm_scale, sliding_window=sliding_window,
                                          soft_cap=soft_cap)
    merged = merge_by_lse(out_prefix, lse_prefix, out_image, lse_image)
    return out.at[rows].set(merged.astype(out.dtype), mode="drop"), kv_cache


def _within_images(q, k, v, num_images, slots: int, *, sm_scale, sliding_window, soft_cap):
    """(out [N L, Hq, D] float32, lse [N L, Hq]) of each image row against its own image's L
    keys (a key before the row beyond the window masked), for the first `num_images` images
    (the rest: out 0, lse -inf)."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[1]
    group, length = num_q_heads // num_kv_heads, q.shape[0] // slots
    q = q.reshape(slots, length, num_kv_heads, group, head_dim)
    k = widened(k, q.dtype).reshape(slots, length, num_kv_heads, head_dim)
    v = widened(v, q.dtype).reshape(slots, length, num_kv_heads, v.shape[-1])
    offsets = jnp.arange(length)
    seen = jnp.ones((length, length), jnp.bool_)
    if sliding_window:  # key j of the image, row i: within the window from i's position
        seen = offsets[None, :] > offsets[:, None] - sliding_window

    def one_image(j, carry):
        out, lse = carry
        scores = jnp.einsum("ihgd,jhd->hgij", q[j], k[j],
                            preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(seen, scores, -jnp.inf)
        top = jax.nn.logsumexp(scores, axis=-1)  # every row sees itself: finite
        probs = jnp.exp(scores - top[..., None])
        rows = jnp.einsum("hgij,jhd->ihgd", probs.astype(v.dtype), v[j],
                          preferred_element_type=jnp.float32)
        return (out.at[j].set(rows), lse.at[j].set(top.transpose(2, 0, 1)))

    out = jnp.zeros((slots, length, num_kv_heads, group, v.shape[-1]), jnp.float32)
    lse = jnp.full((slots, length, num_kv_heads, group), -jnp.inf, jnp.float32)
    out, lse = lax.fori_loop(0, num_images, one_image, (out, lse))
    return (out.reshape(slots * length, num_q_heads, -1),
            lse.reshape(slots * length, num_q_heads))
