"""Sort-free top_k/top_p/min_p thresholds (fast candidate path; exact search by bisection, or 4
bits a pass branch-free) and the one-uniform categorical draw, against NumPy sorts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.runtime.sampling.sampler import _inverse_cdf
from xlaserve.runtime.sampling.truncation import (MASKED, _from_ordered_keys, _ordered_keys,
                                          _searched_thresholds, truncate)


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


@pytest.mark.parametrize("branch_free", [False, True])
@pytest.mark.parametrize("num_candidates", [256, 16, 1])
def test_thresholds_equal_a_full_sort_on_a_real_vocabulary_size(num_candidates, branch_free):
    """49152 tokens, flat and peaked rows, ties, masked entries: the fast path covers the peaked
    rows; the flat ones with a high top_p need the exact search (under a lax.cond, or in every
    call of an accelerator's branch-free program)."""
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
                               jnp.asarray(min_p), num_candidates, branch_free))
    expected = np_truncate(x, top_k, top_p, min_p)
    for i in range(rows):
        np.testing.assert_array_equal(ours[i] > MASKED, expected[i] > MASKED, err_msg=f"row {i}")
    assert (ours[2] > MASKED).sum() == 100  # top_k=50 inside a 100-way tie keeps the whole tie


def _bisection(scaled, k, top_k_on, top_p):
    """The exact search as it was before the 4-bit one: two 32-step bisections."""
    keys = _ordered_keys(scaled)
    lowest, highest = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    def halve(condition):
        def body(_, bounds):
            lo, hi = bounds
            mid = lo + (hi - lo) // 2
            ok = condition(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
        return body

    kth_key, _ = jax.lax.fori_loop(
        0, 32, halve(lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k), (lowest, highest + 1))
    in_top_k = jnp.where(top_k_on[:, None], keys >= kth_key[:, None], True)
    norm = jax.nn.logsumexp(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1)
    probs = jnp.where(in_top_k, jnp.exp(scaled - norm[:, None]), 0.0)
    _, top_p_key = jax.lax.fori_loop(0, 32, halve(
        lambda t: jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1) >= top_p),
        (lowest - 1, highest))
    return _from_ordered_keys(kth_key), _from_ordered_keys(top_p_key)


@pytest.mark.parametrize("bits_per_pass", [1, 4])
def test_searched_thresholds_equal_two_bisections_at_the_edges(bits_per_pass):
    """Every key boundary case: top_k 1 and the whole vocabulary, top_p 0 (reached everywhere),
    a top_p just under 1 (which rounding may leave unreached), all-masked and constant rows,
    infinities among the keys' neighbours."""
    rng = np.random.default_rng(1)
    rows, vocab = 10, 3000
    x = rng.normal(size=(rows, vocab)).astype(np.float32) * 4
    x[4] = MASKED
    x[5] = 1.25
    x[6, :5] = 3e38
    x[7] = np.round(x[7])
    k = np.array([1, vocab, 17, 2999, 1, vocab, 3, 1000, 2, 500], np.int32)
    top_p = np.array([0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5, 0.999, 0.9, 0.3,
                      0.6, 0.95, 1e-8, 0.7], np.float32)
    args = (jnp.asarray(x), jnp.asarray(k), jnp.asarray(k < vocab), jnp.asarray(top_p))
    expected = jax.jit(_bisection)(*args)
    got = jax.jit(_searched_thresholds, static_argnums=4)(*args, bits_per_pass)
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_inverse_cdf_draw_skips_zero_probability_tokens_at_both_ends():
    logits = np.full((3, 600), MASKED, np.float32)
    logits[:, [0, 299, 599]] = [0.0, 1.0, 2.0]
    logits[:, 0] = MASKED  # zero probability at the very start
    uniforms = jnp.asarray([0.0, 0.5, np.nextafter(np.float32(1), np.float32(0))])
    tokens = np.asarray(_inverse_cdf(jnp.asarray(logits), uniforms))
    assert tokens[0] == 299 and tokens[2] == 599
    assert tokens[1] in (299, 599)
