"""Gemma 3's and Gemma 4's image tokens' attention (image_spans.py): a step's images found from
their rows' negative ids, each image row seeing its whole image and the rest causally, in a
sliding window from its own position too; images of one length (Gemma 3's) and of several
(Gemma 4's, `fewest` below `longest`); every platform's kernel (the CPU's, the TPU and GPU kernels in
interpret mode) as the causal part and the `prefix_only` part equals a dense float64 attention
over exactly those keys, on NaN-poisoned cases (cases.make_case), and the cache holds the new
K/V as the causal kernel wrote them. The CPU kernel's `prefix_only` rows take their window from
their own position, as the reference's do (attention_common.h, RowKeys)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.test_tree_attention import PREFIX_KERNELS, dense_attention
from xlaserve.pallas_kernels.ragged_paged_attention import cases, kernel_cpu, reference
from xlaserve.pallas_kernels.ragged_paged_attention.image_spans import (image_span_attention,
                                                                        image_spans)

HEAD_DIM, NUM_Q_HEADS, NUM_KV_HEADS = 32, 8, 2
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
IMAGE = 6  # tokens an image (Gemma 3's: all one length), or the most (Gemma 4's)
SHAPES = dict(max_seqs=6, num_tokens=48, page_size=16, pages_per_seq=6, num_pages=40,
              num_kv_heads=NUM_KV_HEADS, num_q_heads=NUM_Q_HEADS, head_dim=HEAD_DIM)
# Each live sequence: (new tokens, prefix before the step, its images (start among them,
# length)).
SEQS = [
    (12, 13, [(2, IMAGE)]),  # an image across a page boundary (positions 15..20)
    (IMAGE, 0, [(0, IMAGE)]),  # a prompt that is an image alone: no prefix
    (5, 40, []),  # text only
    (2 * IMAGE + 3, 33, [(1, IMAGE), (IMAGE + 2, IMAGE)]),  # two images, two tokens between
    (1, 20, []),  # a decoding row
]
# Gemma 4's: images of 3 to 6 tokens, two of them back to back in the first sequence.
VARIED = [
    (12, 13, [(2, 4), (6, 3)]),
    (5, 0, [(0, 5)]),
    (5, 40, []),
    (2 * IMAGE + 3, 33, [(1, IMAGE), (IMAGE + 2, 3)]),
    (1, 20, []),
]
FEWEST = 3


def make_image_case(seed=0, seqs=SEQS):
    rng = np.random.default_rng(seed)
    case = cases.make_case(rng, [(n, prefix + n) for n, prefix, _ in seqs], **SHAPES)
    ids = np.full(SHAPES["num_tokens"], 0, np.int32)
    positions = np.zeros(SHAPES["num_tokens"], np.int32)
    # each row's image as (its first position, its end), for the oracle; (-1, -1) for text
    image_of = np.full((SHAPES["num_tokens"], 2), -1)
    row, image = 0, 0
    for n, prefix, images in seqs:
        ids[row:row + n] = 7
        positions[row:row + n] = prefix + np.arange(n)
        for start, length in images:
            image += 1
            ids[row + start:row + start + length] = -image
            image_of[row + start:row + start + length] = (prefix + start,
                                                          prefix + start + length)
        row += n
    case.update(input_ids=ids, positions=positions, image_of=image_of)
    return case


def expected(case, window):
    """Dense float64 attention: row p sees keys k <= p, or its image's, and k > p - window."""

    def seen(row, prefix, keys):
        pos = case["positions"][row]
        visible = keys <= pos
        first, end = case["image_of"][row]
        if first >= 0:
            visible |= (keys >= first) & (keys < end)
        return visible & (keys > pos - window) if window else visible

    return dense_attention(case, seen, SHAPES["page_size"], SM_SCALE)


def run_images(kernel, case, window, fewest=None):
    args = {k: jnp.asarray(v) for k, v in case.items() if k != "image_of"}

    def attend(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, ids, positions):
        out, kv_cache = kernel(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                               sm_scale=SM_SCALE, sliding_window=window)
        spans = image_spans(ids, positions, cu_q_lens, page_indices, IMAGE, fewest)
        return image_span_attention(kernel, q, k, v, kv_cache, out, spans, sm_scale=SM_SCALE,
                                    sliding_window=window)

    names = ("q", "k", "v", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "num_seqs",
             "input_ids", "positions")
    return jax.jit(attend)(*(args[n] for n in names))


@pytest.mark.parametrize("seqs", ["one length", "varied"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kernel_name", list(PREFIX_KERNELS))
def test_image_rows_see_their_whole_image_and_the_rest_causally(kernel_name, window, seqs):
    varied = seqs == "varied"
    case = make_image_case(seqs=VARIED if varied else SEQS)
    out, cache = run_images(PREFIX_KERNELS[kernel_name], case, window,
                            FEWEST if varied else None)
    want, want_cache = expected(case, window)
    live = int(case["cu_q_lens"][case["num_seqs"][0]])
    np.testing.assert_allclose(np.asarray(out)[:live], want[:live], atol=2e-5, rtol=0)
    assert not np.asarray(out)[live:].any()  # padding rows stay 0
    np.testing.assert_array_equal(np.asarray(cache), want_cache)


def test_the_spans_found_from_the_ids():
    case = make_image_case()
    spans = image_spans(jnp.asarray(case["input_ids"]), jnp.asarray(case["positions"]),
                        jnp.asarray(case["cu_q_lens"]), jnp.asarray(case["page_indices"]), IMAGE)
    assert spans.kv_lens.shape == (SHAPES["num_tokens"] // IMAGE,)
    assert int(spans.num_images[0]) == 4
    cu = np.asarray(spans.cu_q_lens)
    assert cu[:6].tolist() == [0, IMAGE, 2 * IMAGE, 3 * IMAGE, 4 * IMAGE, 4 * IMAGE]
    starts = np.asarray(spans.rows)[cu[:4]].tolist()
    assert starts == [2, 12, 23 + 1, 23 + IMAGE + 2]
    # Each image a sequence whose kv_len is the image's end: its sequence's pages.
    assert np.asarray(spans.kv_lens)[:5].tolist() == [13 + 2 + IMAGE, IMAGE, 34 + IMAGE,
                                                      33 + IMAGE + 2 + IMAGE, 0]
    np.testing.assert_array_equal(np.asarray(spans.page_indices)[3], case["page_indices"][3])
    assert (np.asarray(spans.rows)[4 * IMAGE:] == SHAPES["num_tokens"]).all()
    # Gemma 4's: images of several lengths, two of them adjacent, told apart by their ids.
    case = make_image_case(seqs=VARIED)
    spans = image_spans(jnp.asarray(case["input_ids"]), jnp.asarray(case["positions"]),
                        jnp.asarray(case["cu_q_lens"]), jnp.asarray(case["page_indices"]), IMAGE,
                        FEWEST)
    assert spans.kv_lens.shape == (SHAPES["num_tokens"] // FEWEST,)
    assert np.diff(np.asarray(spans.cu_q_lens))[:6].tolist() == [4, 3, 5, IMAGE, 3, 0]
    assert np.asarray(spans.kv_lens)[:5].tolist() == [13 + 6, 13 + 9, 5, 33 + 1 + IMAGE,
                                                      33 + IMAGE + 5]
    assert image_spans(jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32),
                       jnp.zeros(2, jnp.int32), jnp.zeros((1, 1), jnp.int32), IMAGE) is None


@pytest.mark.parametrize("bf16_pairs", [False, None])
def test_the_cpu_kernels_prefix_rows_take_their_window_from_their_own_position(bf16_pairs):
    """A prefix_only row of a step's later tokens: the window reaches back from its own
    position (the reference's rule), not from the prefix's last key."""
    rng = np.random.default_rng(3)
    case = cases.make_case(rng, [(10, 30), (3, 3), (7, 50)], **SHAPES)
    dtype = jnp.bfloat16 if bf16_pairs is None else jnp.float32
    args = [jnp.asarray(case[n]).astype(dtype) if n in ("q", "k", "v", "kv_cache")
            else jnp.asarray(case[n]) for n in ("q", "k", "v", "kv_cache", "kv_lens",
                                                "page_indices", "cu_q_lens", "num_seqs")]
    options = dict(sm_scale=SM_SCALE, sliding_window=5, prefix_only=True)
    want_out, want_lse, _ = reference.ragged_paged_attention(*args, **options)
    out, lse, _ = kernel_cpu.ragged_paged_attention(*args, **options, bf16_pairs=bf16_pairs)
    live = 20
    tolerance = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32)[:live],
                               np.asarray(want_out, np.float32)[:live], atol=tolerance)
    np.testing.assert_allclose(np.asarray(lse)[:live], np.asarray(want_lse)[:live],
                               atol=tolerance)
    assert np.isneginf(np.asarray(lse)[5:10]).all()  # past the window of every prefix key

