"""top_k / top_p / min_p as per-row thresholds on the logit, found without sorting the vocabulary.

Each filter keeps the tokens whose (temperature-scaled) logit is at least a threshold, so tokens
tied with the last kept one are kept too. The obvious way, one descending sort per row, is what
XLA's CPU backend does worst: sorting f32[64, 49152] took 680 ms, more than the model's forward
step. So:

- fast path: `lax.top_k` of the best B candidates per row (13 ms for B=256 at that shape) gives
  the exact thresholds of every row whose top_k is <= B and whose top_p mass is reached within
  those B candidates;
- rows where it is not (a flat distribution with a high top_p, or top_k > B): exact thresholds by
  a search over the order-preserving integer image of the f32 logits: a bisection (32 masked
  counts or sums over the vocabulary per filter) run only when some row in the batch needs it,
  or, in an accelerator's branch-free program, a search fixing 4 bits a pass (8 passes of 15).

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


# Bits of the threshold key found per pass over the vocabulary. The run-time program (CPU) takes
# the search only when some row needs it and finds one bit a pass (32 passes, one count or sum
# each: a bisection). Accelerator programs take it in every truncating step, branch-free (a
# conditional is a host sync on a GPU), and find 4 bits a pass: 8 passes of 15 counts (or sums)
# per key instead of 32 of one, i.e. 16 passes over f32[S, V] for both keys (~2.1 GB at 256
# rows of a 128256 vocabulary, ~0.6 ms of an H100, where the 64 passes of a bisection are ~8 GB).
BISECTION_BITS = 1
BRANCH_FREE_BITS = 4


def _largest_key_where(condition, num_rows: int, bits_per_pass: int) -> jax.Array:
    """u32[S]: per row, the largest key t for which `condition` holds, for a condition that
    holds up to some key and not above it (assumed to hold at 0). `condition` maps candidate
    keys u32[S, C] to bool[S, C]. Fixes `bits_per_pass` bits of t a pass, from the top, in a
    loop of a constant trip count."""
    digits = jnp.arange(1, 1 << bits_per_pass, dtype=jnp.uint32)  # digit 0 holds already

    def fix_digit(i, prefix):
        shift = (32 - bits_per_pass * (i + 1)).astype(jnp.uint32)
        holds = condition(prefix[:, None] | (digits[None, :] << shift))
        return prefix | (jnp.sum(holds, axis=-1).astype(jnp.uint32) << shift)

    return jax.lax.fori_loop(0, 32 // bits_per_pass, fix_digit,
                             jnp.zeros(num_rows, jnp.uint32))


def _searched_thresholds(scaled, k, top_k_on, top_p, bits_per_pass: int):
    """The same thresholds as `_fast_thresholds` by a search over the whole vocabulary (no
    candidate bound), on the order-preserving u32 keys of the logits."""
    keys = _ordered_keys(scaled)
    lowest, highest = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    # k-th largest value: the largest key t with count(keys >= t) >= k.
    def enough_tokens(t):
        return jnp.sum(keys[:, None, :] >= t[:, :, None], axis=-1) >= k[:, None]
    kth_key = _largest_key_where(enough_tokens, keys.shape[0], bits_per_pass)
    in_top_k = jnp.where(top_k_on[:, None], keys >= kth_key[:, None], True)
    norm = jax.nn.logsumexp(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1)
    probs = jnp.where(in_top_k, jnp.exp(scaled - norm[:, None]), 0.0)

    # top_p threshold: the smallest key t in [lowest, highest] with mass(keys > t) < top_p (it is
    # always some token's key: the mass only changes at token keys), i.e. one above the largest t
    # where the mass reaches top_p, kept in [lowest, highest] (rounding can leave the whole mass
    # under a top_p near 1; a top_p <= 0 is reached everywhere).
    def mass_reaches_top_p(t):
        mass = jnp.sum(jnp.where(keys[:, None, :] > t[:, :, None], probs[:, None, :], 0.0), axis=-1)
        return mass >= top_p[:, None]
    reached = _largest_key_where(mass_reaches_top_p, keys.shape[0], bits_per_pass)
    top_p_key = jnp.where(reached >= highest, highest, jnp.maximum(reached + 1, lowest))
    return _from_ordered_keys(kth_key), _from_ordered_keys(top_p_key)


def truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
             num_candidates: int = NUM_CANDIDATES, branch_free: bool = False) -> jax.Array:
    """`scaled` (f32[S, V], masked entries = MASKED) with everything outside top_k (<= 0: off),
    top_p (>= 1: off) and min_p (<= 0: off) set to MASKED. `branch_free`: the exact search runs
    in every call (4 bits a pass) rather than under a `lax.cond` on whether some row needs it
    (one bit a pass); the results are the same."""
    vocab_size = scaled.shape[-1]
    num_candidates = min(num_candidates, vocab_size)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    top_k_on = k < vocab_size
    top_p_on = top_p < 1.0

    kth, top_p_threshold, exact = _fast_thresholds(scaled, k, top_k_on, top_p, top_p_on, num_candidates)

    def exact_for_every_row(bits_per_pass):
        slow_kth, slow_top_p = _searched_thresholds(scaled, k, top_k_on, top_p, bits_per_pass)
        return jnp.where(exact, kth, slow_kth), jnp.where(exact, top_p_threshold, slow_top_p)

    if branch_free:
        kth, top_p_threshold = exact_for_every_row(BRANCH_FREE_BITS)
    else:
        kth, top_p_threshold = jax.lax.cond(jnp.all(exact), lambda: (kth, top_p_threshold),
                                            lambda: exact_for_every_row(BISECTION_BITS))
    # p < min_p * p_max  <=>  logit < top_logit + log(min_p), whatever the normalization.
    top = jnp.max(scaled, axis=-1)
    min_p_threshold = top + jnp.log(jnp.maximum(min_p, 1e-30))
    threshold = jnp.maximum(
        jnp.maximum(jnp.where(top_k_on, kth, MASKED), jnp.where(top_p_on, top_p_threshold, MASKED)),
        jnp.where(min_p > 0, min_p_threshold, MASKED))
    return jnp.where(scaled >= threshold[:, None], scaled, MASKED)
