"""top_k / top_p / min_p as per-row thresholds on the logit, found without sorting the vocabulary.

Each filter keeps the tokens whose (temperature-scaled) logit is at least a threshold, so tokens
tied with the last kept one are kept too. The obvious way, one descending sort per row, is what
XLA's CPU backend does worst: sorting f32[64, 49152] took 680 ms, more than the model's forward
step. So:

- fast path: `lax.top_k` of the best B candidates per row (13 ms for B=256 at that shape) gives
  the exact thresholds of every row whose top_k is <= B and whose top_p mass is reached within
  those B candidates;
- rows where it is not (a flat distribution with a high top_p, or top_k > B): exact thresholds by
  bisection over the order-preserving integer image of the f32 logits, 32 masked counts or sums
  over the vocabulary per filter, run only when some row in the batch needs it.

A row's thresholds depend only on that row (which path it takes too), never on the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # the value of a masked-out logit (see sampler.py)
NUM_CANDIDATES = 256


def _ordered_keys(x: jax.Array) -> jax.Array:
    """u32 keys with the same order as the f32 values: flip every bit of negatives, only the
    sign bit of non-negatives."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _from_ordered_keys(keys: jax.Array) -> jax.Array:
    positive = (keys >> 31) == 1
    bits = jnp.where(positive, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def row_take(values: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take_along_axis(values, index[:, None], axis=-1)[:, 0]


def _fast_thresholds(scaled, k, top_k_on, top_p, top_p_on, num_candidates: int):
    """(top_k threshold, top_p threshold, exact?) per row, from the top candidates."""
    values = jax.lax.top_k(scaled, num_candidates)[0]  # descending
    kth = row_take(values, jnp.minimum(k, num_candidates) - 1)
    in_top_k = values >= kth[:, None]
    # top_p is over the distribution top_k leaves: normalized over the kept tokens when top_k is
    # on (all of them among the candidates), over the whole vocabulary when it is off.
    norm = jnp.where(top_k_on,
                     jax.nn.logsumexp(jnp.where(in_top_k, values, -jnp.inf), axis=-1),
                     jax.nn.logsumexp(scaled, axis=-1))
    probs = jnp.where(in_top_k, jnp.exp(values - norm[:, None]), 0.0)
    # Keep the smallest prefix reaching top_p: every token whose predecessors hold less than top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.maximum(jnp.sum(in_top_k & (mass_before < top_p[:, None]), axis=-1), 1)
    top_p_threshold = row_take(values, num_kept - 1)
    top_k_fits = top_k_on & (k <= num_candidates)
    exact = (~top_k_on | top_k_fits) & (~top_p_on | top_k_fits | (jnp.sum(probs, axis=-1) >= top_p))
    return kth, top_p_threshold, exact


def _bisected_thresholds(scaled, k, top_k_on, top_p):
    """The same thresholds by bisection over the whole vocabulary (no candidate bound)."""
    keys = _ordered_keys(scaled)
    lowest, highest = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    def halve(condition):
        # Finds the boundary key between lo (condition true) and hi (false) in 32 halvings,
        # enough for any u32 range.
        def body(_, bounds):
            lo, hi = bounds
            mid = lo + (hi - lo) // 2
            ok = condition(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
        return body

    # k-th largest value: the largest key t with count(keys >= t) >= k.
    def enough_tokens(t):
        return jnp.sum(keys >= t[:, None], axis=-1) >= k
    kth_key, _ = jax.lax.fori_loop(0, 32, halve(enough_tokens), (lowest, highest + 1))
    in_top_k = jnp.where(top_k_on[:, None], keys >= kth_key[:, None], True)
    norm = jax.nn.logsumexp(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1)
    probs = jnp.where(in_top_k, jnp.exp(scaled - norm[:, None]), 0.0)

    # top_p threshold: the smallest key t with mass(keys > t) < top_p (it is always some token's
    # key: the mass only changes at token keys). lo starts below every key, where the mass is 1.
    def mass_reaches_top_p(t):
        return jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1) >= top_p
    _, top_p_key = jax.lax.fori_loop(0, 32, halve(mass_reaches_top_p), (lowest - 1, highest))
    return _from_ordered_keys(kth_key), _from_ordered_keys(top_p_key)


def truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
             num_candidates: int = NUM_CANDIDATES) -> jax.Array:
    """`scaled` (f32[S, V], masked entries = MASKED) with everything outside top_k (<= 0: off),
    top_p (>= 1: off) and min_p (<= 0: off) set to MASKED."""
    vocab_size = scaled.shape[-1]
    num_candidates = min(num_candidates, vocab_size)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    top_k_on = k < vocab_size
    top_p_on = top_p < 1.0

    kth, top_p_threshold, exact = _fast_thresholds(scaled, k, top_k_on, top_p, top_p_on, num_candidates)

    def exact_for_every_row():
        slow_kth, slow_top_p = _bisected_thresholds(scaled, k, top_k_on, top_p)
        return jnp.where(exact, kth, slow_kth), jnp.where(exact, top_p_threshold, slow_top_p)

    kth, top_p_threshold = jax.lax.cond(jnp.all(exact), lambda: (kth, top_p_threshold),
                                        exact_for_every_row)
    # p < min_p * p_max  <=>  logit < top_logit + log(min_p), whatever the normalization.
    top = jnp.max(scaled, axis=-1)
    min_p_threshold = top + jnp.log(jnp.maximum(min_p, 1e-30))
    threshold = jnp.maximum(
        jnp.maximum(jnp.where(top_k_on, kth, MASKED), jnp.where(top_p_on, top_p_threshold, MASKED)),
        jnp.where(min_p > 0, min_p_threshold, MASKED))
    return jnp.where(scaled >= threshold[:, None], scaled, MASKED)
