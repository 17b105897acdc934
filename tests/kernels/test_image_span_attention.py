"""Gemma 3's image tokens' attention (image_spans.py): a step's images found from their rows'
negative ids, each image row seeing its whole image and the rest causally, in a sliding window
from its own position too; every platform's kernel (the CPU's, the TPU and GPU kernels in
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
IMAGE = 6  # tokens an image
SHAPES = dict(max_seqs=6, num_tokens=48, page_size=16, pages_per_seq=6, num_pages=40,
              num_kv_heads=NUM_KV_HEADS, num_q_heads=NUM_Q_HEADS, head_dim=HEAD_DIM)
# Each live sequence: (new tokens, prefix before the step, where its images start among them).
SEQS = [
    (12, 13, [2]),  # an image across a page boundary (positions 15..20)
    (IMAGE, 0, [0]),  # a prompt that is an image alone: no prefix
    (5, 40, []),  # text only
    (2 * IMAGE + 3, 33, [1, IMAGE + 2]),  # two images, two tokens of text between
    (1, 20, []),  # a decoding row
]


def make_image_case(seed=0):
    rng = np.random.default_rng(seed)
    case = cases.make_case(rng, [(n, prefix + n) for n, prefix, _ in SEQS], **SHAPES)
    ids = np.full(SHAPES["num_tokens"], 0, np.int32)
    positions = np.zeros(SHAPES["num_tokens"], np.int32)
    image_of = np.full(SHAPES["num_tokens"], -1)  # each row's image (its first row), for the oracle
    row, image = 0, 0
    for n, prefix, starts in SEQS:
        ids[row:row + n] = 7
        positions[row:row + n] = prefix + np.arange(n)
        for start in starts:
            image += 1
            ids[row + start:row + start + IMAGE] = -image
            image_of[row + start:row + start + IMAGE] = row + start
        row += n
    case.update(input_ids=ids, positions=positions, image_of=image_of)
    return case


def expected(case, window):
    """Dense float64 attention: row p sees keys k <= p, or its image's, and k > p - window."""

    def seen(row, prefix, keys):
        pos = case["positions"][row]
        visible = keys <= pos
        if case["image_of"][row] >= 0:
            first = case["positions"][case["image_of"][row]]
            visible |= (keys >= first) & (keys < first + IMAGE)
        return visible & (keys > pos - window) if window else visible

    return dense_attention(case, seen, SHAPES["page_size"], SM_SCALE)


def run_images(kernel, case, window):
    args = {k: jnp.asarray(v) for k, v in case.items() if k != "image_of"}

    def attend(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, ids, positions):
        out, kv_cache = kernel(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                               sm_scale=SM_SCALE, sliding_window=window)
        spans = image_spans(ids, positions, cu_q_lens, page_indices, IMAGE)
        return image_span_attention(kernel, q, k, v, kv_cache, out, spans, sm_scale=SM_SCALE,
                                    sliding_window=window)

    names = ("q", "k", "v", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "num_seqs",
             "input_ids", "positions")
    return jax.jit(attend)(*(args[n] for n in names))


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kernel_name", list(PREFIX_KERNELS))
def test_image_rows_see_their_whole_image_and_the_rest_causally(kernel_name, window):
    case = make_image_case()
    out, cache = run_images(PREFIX_KERNELS[kernel_name], case, window)
    want, want_cache = expected(case, window)
    live = int(case["cu_q_lens"][case["num_seqs"][0]])
    np.testing.assert_allclose(np.asarray(out)[:live], want[:live], atol=2e-5, rtol=0)
    assert not np.asarray(out)[live:].any()  # padding rows stay 0
    np.testing.assert_array_equal(np.asarray(cache), want_cache)


def test_the_spans_found_from_the_ids():
    case = make_image_case()
    spans = image_spans(jnp.asarray(case["input_ids"]), jnp.asarray(case["positions"]),
                        jnp.asarray(case["cu_q_lens"]), jnp.asarray(case["page_indices"]), IMAGE)
    assert spans.rows.shape == (SHAPES["num_tokens"] // IMAGE, IMAGE)
    assert int(spans.num_images[0]) == 4
    starts = np.asarray(spans.rows)[:4, 0].tolist()
    assert starts == [2, 12, 23 + 1, 23 + IMAGE + 2]
    # Each image a sequence whose kv_len is the image's end: its sequence's pages.
    assert np.asarray(spans.kv_lens)[:5].tolist() == [13 + 2 + IMAGE, IMAGE, 34 + IMAGE,
                                                      33 + IMAGE + 2 + IMAGE, 0]
    np.testing.assert_array_equal(np.asarray(spans.page_indices)[3], case["page_indices"][3])
    assert (np.asarray(spans.rows)[4:] == SHAPES["num_tokens"]).all()
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

