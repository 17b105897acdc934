"""Sort-free top_k/top_p/min_p thresholds (fast candidate path and bisection path) and the
one-uniform categorical draw, against NumPy sorts."""
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.sampling.sampler import _inverse_cdf
from xlaserve.sampling.truncation import MASKED, _from_ordered_keys, _ordered_keys, truncate


def np_truncate(x, top_k, top_p, min_p):
    """Reference: one descending sort per row, thresholds on the value, ties kept."""
    out = np.full_like(x, MASKED)
    for i, row in enumerate(x.astype(np.float64)):
        order = np.sort(row)[::-1]
        threshold = MASKED
        k = top_k[i] if top_k[i] > 0 else len(row)
        kth = order[min(k, len(row)) - 1]
        if top_k[i] > 0:
            threshold = kth
        if top_p[i] < 1:
            kept = np.where(order >= kth, order, -np.inf)
            probs = np.exp(kept - kept.max())
            probs /= probs.sum()
            before = np.cumsum(probs) - probs
            num_kept = max(int(np.sum((before < top_p[i]) & (order >= kth))), 1)
            threshold = max(threshold, order[num_kept - 1])
        if min_p[i] > 0:
            threshold = max(threshold, order[0] + np.log(min_p[i]))
        out[i] = np.where(row >= threshold, row, MASKED)
    return out


def test_ordered_keys_preserve_order_and_round_trip():
    values = np.array([-np.inf, MASKED, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 3e38, np.inf], np.float32)
    keys = np.asarray(_ordered_keys(jnp.asarray(values)))
    assert (np.diff(keys.astype(np.int64)) >= 0).all()
    back = np.asarray(_from_ordered_keys(jnp.asarray(keys)))
    np.testing.assert_array_equal(back, values)


@pytest.mark.parametrize("num_candidates", [256, 16, 1])
def test_thresholds_equal_a_full_sort_on_a_real_vocabulary_size(num_candidates):
    """49152 tokens, flat and peaked rows, ties, masked entries: the fast path covers the peaked
    rows; the flat ones with a high top_p need the bisection path."""
    rng = np.random.default_rng(0)
    rows, vocab = 8, 49152
    x = rng.normal(size=(rows, vocab)).astype(np.float32)
    x[0] *= 0.1  # flat: top_p 0.95 needs thousands of tokens
    x[1] *= 8.0  # peaked
    x[2, :100] = 5.0  # a 100-way tie at the top
    x[3, rng.integers(0, vocab, 500)] = MASKED
    x = np.round(x, 2)  # many ties everywhere
    top_k = np.array([-1, -1, 50, 300, 5000, -1, 1, 20], np.int32)
    top_p = np.array([0.95, 0.9, 1.0, 0.8, 0.99, 1.0, 1.0, 0.5], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.01, 0.0, 0.2, 0.0, 0.0], np.float32)
    ours = np.asarray(truncate(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p),
                               jnp.asarray(min_p), num_candidates))
    expected = np_truncate(x, top_k, top_p, min_p)
    for i in range(rows):
        np.testing.assert_array_equal(ours[i] > MASKED, expected[i] > MASKED, err_msg=f"row {i}")
    assert (ours[2] > MASKED).sum() == 100  # top_k=50 inside a 100-way tie keeps the whole tie


def test_inverse_cdf_draw_skips_zero_probability_tokens_at_both_ends():
    logits = np.full((3, 600), MASKED, np.float32)
    logits[:, [0, 299, 599]] = [0.0, 1.0, 2.0]
    logits[:, 0] = MASKED  # zero probability at the very start
    uniforms = jnp.asarray([0.0, 0.5, np.nextafter(np.float32(1), np.float32(0))])
    tokens = np.asarray(_inverse_cdf(jnp.asarray(logits), uniforms))
    assert tokens[0] == 299 and tokens[2] == 599
    assert tokens[1] in (299, 599)
