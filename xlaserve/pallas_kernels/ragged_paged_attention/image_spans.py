"""Attention for the image tokens of Gemma 3 and Gemma 4: each sees every token of its own image,
later ones too, and the rest causally (transformers' `token_type_ids` / `mm_token_type_ids`
mask: causal OR same image; in a sliding layer AND the window, which from the query's own
position only bounds the keys before it), so an image token at position p of an image [s, e)
attends to the keys [first_key(p), e). Gemma 3's images do so in every layer, Gemma 4's in its
sliding layers only (`sliding_layers_only`: its full layers stay causal).

A step's images are runs of at most `longest` rows (Gemma 3: every image the same length;
Gemma 4: each its own, by its aspect ratio), all of an image in one step (the scheduler never
cuts one, and the prefix cache never ends a match inside one: runtime/scheduler/request.py,
`whole_span_end`). The causal kernel runs every row as always; the image rows' outputs are then
replaced by two parts merged by log-sum-exp (`reference.merge_by_lse`), as speculative tree
rows' are (tree_tokens.py):
- the keys before the image: the platform's kernel with `prefix_only` over a batch of the
  images alone, their rows packed in step order: image j is a sequence whose new tokens are its
  rows and whose kv_len is its end e, so its rows sit at their own positions (the window from
  there) and its prefix is [0, s). The kernel writes the image's K/V at [s, e) again: the values
  the causal call wrote.
- the image's own keys: a dense [longest, longest] score block per image and head (keys past
  the image's end masked; the window too), in jnp, one image at a time for as many as the step
  has (a loop of dynamic length: a step without images does none), each block written at the
  image's place in the packed rows in order, so that a block's rows past its image are
  overwritten by the next image's.
Why not a per-row key limit in the four kernels: this reuses `prefix_only`, which every kernel
has and is tested on, at the cost of the image rows' prefix read twice (their causal outputs
are thrown away), which is small beside the step (measured: docs/server.md, Gemma 3).

The images are found on the device: their rows' ids are negative, one value per image of the
step (runtime/executor/image_rows.add_image_rows), so an image opens where a row's id is
negative and differs from the row before's, and closes where it differs from the row after's.
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
    """A step's images as a batch of their own for the kernel: N sequences at most."""

    rows: jax.Array  # i32[T]: the step's image rows in step order (packed); T past the last
    kv_lens: jax.Array  # i32[N]: each image's end position (its sequence's kv_len there), 0 past
    page_indices: jax.Array  # i32[N, pages]: its sequence's pages
    cu_q_lens: jax.Array  # i32[N + 1]: image j's rows at [cu[j], cu[j + 1]) of `rows`
    num_images: jax.Array  # i32[1]
    longest: int = dataclasses.field(metadata={"static": True})  # rows an image has at most
    # Gemma 4: only the sliding layers' image rows see their whole image (transformers'
    # create_masks_for_vision_model); Gemma 3: every layer's.
    sliding_layers_only: bool = dataclasses.field(default=False, metadata={"static": True})


def image_spans(input_ids, positions, cu_q_lens, page_indices, longest: int,
                fewest: int | None = None, sliding_layers_only: bool = False
                ) -> ImageSpans | None:
    """The step's images (module docstring): `input_ids` i32[T] with negative ids on image rows,
    `positions` i32[T], and the step's cu_q_lens and page table; an image has at most `longest`
    rows and at least `fewest` (default `longest`: Gemma 3's images, all one length), which
    bounds how many a step holds. None where the step is shorter than an image (a decode bucket:
    its program has no image part)."""
    tokens = input_ids.shape[0]
    slots = tokens // (fewest or longest)
    if slots == 0:
        return None
    image = input_ids < 0
    before = jnp.concatenate([jnp.zeros((1,), input_ids.dtype), input_ids[:-1]])
    after = jnp.concatenate([input_ids[1:], jnp.zeros((1,), input_ids.dtype)])
    (starts,) = jnp.nonzero(image & (input_ids != before), size=slots, fill_value=tokens)
    (lasts,) = jnp.nonzero(image & (input_ids != after), size=slots, fill_value=tokens - 1)
    live = starts < tokens
    count = live.sum(dtype=jnp.int32)
    lengths = jnp.where(live, lasts + 1 - starts, 0)
    first = jnp.minimum(starts, tokens - 1)
    seq = jnp.minimum(searchsorted_right(cu_q_lens[1:], first), page_indices.shape[0] - 1)
    (rows,) = jnp.nonzero(image, size=tokens, fill_value=tokens)
    kv_lens = jnp.where(live, positions[first] + lengths, 0)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])
    return ImageSpans(rows=rows.astype(jnp.int32), kv_lens=kv_lens.astype(jnp.int32),
                      page_indices=page_indices[seq], cu_q_lens=cu, num_images=count[None],
                      longest=longest, sliding_layers_only=sliding_layers_only)


def image_span_attention(attention, q, k, v, kv_cache, out, spans: ImageSpans, *, sm_scale,
                         sliding_window=None, soft_cap=None, sinks=None):
    """`out` (the causal kernel's [T, Hq, D] for q [T, Hq, D], k, v [T, Hkv, D]) with its image
    rows' attention over their whole image (module docstring), and the kv_cache the kernel
    (`attention`, reference.ragged_paged_attention's signature with `prefix_only`) returns."""
    num_tokens = q.shape[0]
    taken = jnp.minimum(spans.rows, num_tokens - 1)
    q_img, k_img, v_img = q[taken], k[taken], v[taken]
    out_prefix, lse_prefix, kv_cache = attention(
        q_img, k_img, v_img, kv_cache, spans.kv_lens, spans.page_indices, spans.cu_q_lens,
        spans.num_images, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        sinks=sinks, prefix_only=True)
    out_image, lse_image = _within_images(q_img, k_img, v_img, spans, sm_scale=sm_scale,
                                          sliding_window=sliding_window, soft_cap=soft_cap)
    merged = merge_by_lse(out_prefix, lse_prefix, out_image, lse_image)
    return out.at[spans.rows].set(merged.astype(out.dtype), mode="drop"), kv_cache


def _within_images(q, k, v, spans: ImageSpans, *, sm_scale, sliding_window, soft_cap):
    """(out [T, Hq, D] float32, lse [T, Hq]) of each packed image row against its own image's
    keys (a key before the row beyond the window masked), for the first `num_images` images
    (rows past the last: out 0, lse -inf)."""
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[1], spans.longest
    group = num_q_heads // num_kv_heads
    # Padded by one image, so that the last image's block is a whole slice.
    q = jnp.pad(q, ((0, length), (0, 0), (0, 0))).reshape(-1, num_kv_heads, group, head_dim)
    k = jnp.pad(widened(k, q.dtype), ((0, length), (0, 0), (0, 0)))
    v = jnp.pad(widened(v, q.dtype), ((0, length), (0, 0), (0, 0)))
    offsets = jnp.arange(length)
    window = jnp.ones((length, length), jnp.bool_)
    if sliding_window:  # key j of the image, row i: within the window from i's position
        window = offsets[None, :] > offsets[:, None] - sliding_window

    def one_image(j, carry):
        out, lse = carry
        start, size = spans.cu_q_lens[j], spans.cu_q_lens[j + 1] - spans.cu_q_lens[j]
        q_j = lax.dynamic_slice_in_dim(q, start, length)
        k_j, v_j = (lax.dynamic_slice_in_dim(x, start, length) for x in (k, v))
        # The values past the image zeroed: a masked key's weight is 0, and 0 * NaN is not.
        v_j = jnp.where((offsets < size)[:, None, None], v_j, 0)
        scores = jnp.einsum("ihgd,jhd->hgij", q_j, k_j,
                            preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        # Keys past the image unseen; rows past it (the next image's, overwritten next) see
        # every key, so that no row's softmax is empty.
        seen = (window & (offsets[None, :] < size)) | (offsets[:, None] >= size)
        scores = jnp.where(seen, scores, -jnp.inf)
        top = jax.nn.logsumexp(scores, axis=-1)  # every row sees itself: finite
        probs = jnp.exp(scores - top[..., None])
        block = jnp.einsum("hgij,jhd->ihgd", probs.astype(v_j.dtype), v_j,
                           preferred_element_type=jnp.float32)
        return (lax.dynamic_update_slice_in_dim(out, block, start, 0),
                lax.dynamic_update_slice_in_dim(lse, top.transpose(2, 0, 1), start, 0))

    out = jnp.zeros((rows + length, num_kv_heads, group, v.shape[-1]), jnp.float32)
    lse = jnp.full((rows + length, num_kv_heads, group), -jnp.inf, jnp.float32)
    out, lse = lax.fori_loop(0, spans.num_images[0], one_image, (out, lse))
    return (out[:rows].reshape(rows, num_q_heads, -1),
            lse[:rows].reshape(rows, num_q_heads))
