"""On-device sampling for a batch of sequences, each row with its own sampling parameters.

Everything is vectorized over the S rows (S padded to a bucket) with static shapes, so one program
serves any mix of requests. Processing order, as in vLLM/SGLang:

    logits (f32) -> logit_bias -> repetition penalty -> frequency & presence penalties
    -> suppressed ids masked -> grammar bitmask (structured outputs)
    ==> "penalized" logits: logprobs and greedy argmax come from these
    -> temperature -> top_k -> top_p -> min_p  ==> "processed" logits: sampled from

A row's token depends only on its own logits, parameters, seed and sample_index, never on which
other rows share the batch or at which row index it sits: every row draws from its own key
`fold_in(key(seed), sample_index)`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Masked-out logits get a large finite value (MASKED = -1e30): -inf turns into NaN in softmax of a
# fully masked row and in `-inf - -inf`; -1e30 stays finite through division by any sane temperature.
from xlaserve.runtime.sampling.params import SamplingMetadata
from xlaserve.runtime.sampling.step_needs import (StepNeeds, greedy_rows, only_if_needed, part,
                                         penalty_rows, truncating_rows, zeros_unless)
from xlaserve.runtime.sampling.truncation import MASKED, NUM_CANDIDATES, row_take, truncate


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; of the chosen token, under the penalized distribution
    top_ids: jax.Array  # i32[S, N]; the N most likely tokens, most likely first
    top_logprobs: jax.Array  # f32[S, N]


# --- penalty state: per-row token counts, kept on device -----------------------------------


def _valid_or_out_of_range(ids: jax.Array, vocab_size: int) -> jax.Array:
    # Negative ids are padding. JAX would wrap them around, so send them past the end instead,
    # where scatters with mode="drop" ignore them.
    return jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)


def count_tokens(token_ids: jax.Array, lengths: jax.Array, vocab_size: int) -> jax.Array:
    """i32[S, V]: how often each token occurs in the first `lengths[s]` entries of row s of
    `token_ids` (i32[S, L]). For the prompt mask take `count_tokens(...) > 0`."""
    num_rows, max_len = token_ids.shape
    live = jnp.arange(max_len)[None, :] < lengths[:, None]
    ids = _valid_or_out_of_range(jnp.where(live, token_ids, -1), vocab_size)
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
    counts = jnp.zeros((num_rows, vocab_size), jnp.int32)
    return counts.at[rows, ids].add(1, mode="drop")


def add_sampled(counts: jax.Array, tokens: jax.Array, live: jax.Array,
                rows: jax.Array | None = None) -> jax.Array:
    """Counts the token just sampled for each live row (bool[S]); padding rows stay unchanged.
    `rows` (i32[S]) says which row of `counts` each sample belongs to (a request's slot when
    `counts` holds every slot); by default sample i counts in row i."""
    if rows is None:
        rows = jnp.arange(tokens.shape[0])
    return counts.at[rows, tokens].add(live.astype(counts.dtype), mode="drop")


# --- the pipeline --------------------------------------------------------------------------


def apply_token_bitmask(x: jax.Array, token_bitmask: jax.Array,
                        needed: bool | None = None) -> jax.Array:
    """Sets to MASKED every logit whose bit is clear in `token_bitmask` (i32[S, ceil(V/32)]: token t
    is allowed iff bit t % 32 of word t // 32 is set, llguidance's layout). Only in steps where
    some row has a clear bit (a constrained row): all-ones rows are unconstrained or padding.
    `needed`: see step_needs.only_if_needed."""
    num_rows, vocab_size = x.shape

    def masked():
        bits = jnp.right_shift(token_bitmask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
        allowed = bits.reshape(num_rows, -1)[:, :vocab_size].astype(jnp.bool_)
        return jnp.where(allowed, x, MASKED)

    return only_if_needed(needed, lambda: jnp.any(token_bitmask != -1), masked, lambda: x)


@functools.partial(jax.jit, static_argnames=("needs",))
def penalized_logits(logits, metadata: SamplingMetadata, output_counts, prompt_mask, rows=None,
                     token_bitmask=None, needs: StepNeeds | None = None, prior_ids=None):
    """f32[S, V]: logits after bias, penalties, suppression and the grammar mask; the
    distribution logprobs report. `output_counts`/`prompt_mask` hold one row per sample, or, with
    `rows` (i32[S]), a table that `rows` indexes (the engine's per-slot state): then the [S, V]
    gathers only happen in steps where some row has a penalty on. `needs` (static): the parts
    in the program (step_needs.py); None decides them at run time. `prior_ids` (i32[S, K], -1
    pads): tokens each row's output holds beyond `output_counts` (a speculative verified row's
    drafts before that row's token), counted with them.

    The grammar mask comes last, as a set (not an addition before the penalties): a repetition
    penalty divides a negative logit, which would lift a masked MASKED above MASKED."""
    num_rows, vocab_size = logits.shape
    row_ids = jnp.arange(num_rows)[:, None]
    x = logits.astype(jnp.float32)

    bias_ids = _valid_or_out_of_range(metadata.logit_bias_ids, vocab_size)
    biased = x.at[row_ids, bias_ids].add(metadata.logit_bias_values, mode="drop")

    def apply_penalties():
        counts = output_counts if rows is None else output_counts[rows]
        if prior_ids is not None and prior_ids.shape[1]:
            counts = counts.at[row_ids, _valid_or_out_of_range(prior_ids, vocab_size)].add(
                1, mode="drop")
        prompt = prompt_mask if rows is None else prompt_mask[rows]
        seen = prompt | (counts > 0)
        rep = metadata.repetition_penalty[:, None]
        x = jnp.where(seen, jnp.where(biased > 0, biased / rep, biased * rep), biased)
        x = x - metadata.frequency_penalty[:, None] * counts.astype(jnp.float32)
        return x - metadata.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)

    x = only_if_needed(part(needs, "penalties"), lambda: jnp.any(penalty_rows(metadata)),
                       apply_penalties, lambda: biased)
    suppressed = _valid_or_out_of_range(metadata.suppressed_ids, vocab_size)
    x = x.at[row_ids, suppressed].set(MASKED, mode="drop")
    if token_bitmask is None:
        return x
    return apply_token_bitmask(x, token_bitmask, part(needs, "grammar"))


def _scaled(penalized, metadata: SamplingMetadata):
    # Greedy rows divide by 1: their processed logits are never sampled from, only kept finite.
    temperature = jnp.where(metadata.temperature > 0, metadata.temperature, 1.0)
    # The floor keeps masked entries at MASKED (not -inf) after dividing by a tiny temperature.
    return jnp.maximum(penalized / temperature[:, None], MASKED)


@functools.partial(jax.jit, static_argnames=("num_candidates",))
def processed_logits(logits, metadata: SamplingMetadata, output_counts, prompt_mask, *,
                     num_candidates: int = NUM_CANDIDATES):
    """f32[S, V]: penalized, temperature-scaled and truncated logits, masked entries = MASKED.
    Sampling rows draw from softmax of these; greedy rows (temperature 0) ignore them."""
    penalized = penalized_logits(logits, metadata, output_counts, prompt_mask)
    return truncate(_scaled(penalized, metadata), metadata.top_k, metadata.top_p, metadata.min_p,
                    num_candidates)


_CDF_BLOCK = 256


def _inverse_cdf(logits, uniforms):
    """i32[S]: per row, the token at which the cumulative softmax of `logits` passes `uniforms`
    (f32[S] in [0, 1)), i.e. an exact categorical draw from one random number per row (Gumbel-max
    needs V of them: 69 ms for 64 rows of 49152 on CPU, against ~3 ms here). Two levels of
    cumulative sums (blocks of 256, then inside the chosen block) keep the sums short."""
    num_rows, vocab_size = logits.shape
    padded = -(-vocab_size // _CDF_BLOCK) * _CDF_BLOCK
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.pad(probs, ((0, 0), (0, padded - vocab_size)))
    blocks = probs.reshape(num_rows, -1, _CDF_BLOCK)
    block_mass = blocks.sum(axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = uniforms * block_cdf[:, -1]  # < the last cumulative sum, so some block passes it
    # `<=`: a zero-probability block or token never takes the draw.
    block = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), block_cdf.shape[1] - 1)
    inside = target - (row_take(block_cdf, block) - row_take(block_mass, block))
    block_probs = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    offset = jnp.sum(jnp.cumsum(block_probs, axis=-1) <= inside[:, None], axis=-1)
    # Rounding can leave `inside` at the block's very end: fall back to its last live token.
    last_live = _CDF_BLOCK - 1 - jnp.argmax(block_probs[:, ::-1] > 0, axis=-1)
    return (block * _CDF_BLOCK + jnp.minimum(offset, last_live)).astype(jnp.int32)


def _draw(penalized, metadata: SamplingMetadata, num_candidates: int, needs: StepNeeds | None,
          invariant: bool = False):
    """Sampled tokens for every row (greedy rows' draws are discarded by the caller).
    `invariant`: truncation and the draw row by row (`by_row`)."""
    scaled = _scaled(penalized, metadata)
    cut = functools.partial(truncate, num_candidates=num_candidates,
                            branch_free=needs is not None)
    processed = only_if_needed(
        part(needs, "truncation"), lambda: jnp.any(truncating_rows(metadata)),
        lambda: by_row(cut, invariant, scaled, metadata.top_k, metadata.top_p, metadata.min_p),
        lambda: scaled)
    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed), index))(
        metadata.seeds, metadata.sample_index)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    return by_row(_inverse_cdf, invariant, processed, uniforms)


def by_row(function, invariant: bool, *rows):
    """`function(*rows)` over arrays of S rows; with `invariant`, one row at a time (a loop
    whose body is compiled for one row), so that a row's reductions are summed in the same
    order whatever S is: XLA's CPU reductions over [S, V] change order with S (measured: a
    [S, 576] mean's rows differ in the last bits between S = 1 and S = 23). The cost: a loop
    of S small programs in place of one (--enable-deterministic-inference only)."""
    if not invariant:
        return function(*rows)
    return jax.lax.map(lambda row: function(*(x[None] for x in row))[0], rows)


_ARGMAX_BLOCK = 256


def first_argmax(x: jax.Array) -> jax.Array:
    """i32[S]: jnp.argmax over the last axis (the first index of the maximum), computed as a max
    per block of 256, then an argmax over the small block maxima and inside the chosen block.
    XLA's CPU argmax over [64, 49152] took 7.3 ms (a variadic reduce of value and index); this
    takes 0.3 ms."""
    num_rows, vocab_size = x.shape
    pad = -vocab_size % _ARGMAX_BLOCK
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    blocks = x.reshape(num_rows, -1, _ARGMAX_BLOCK)
    block = jnp.argmax(blocks.max(axis=-1), axis=-1)  # the first block that holds the maximum
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    return (block * _ARGMAX_BLOCK + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def _logprobs(penalized, tokens, num_top_logprobs: int, invariant: bool = False):
    log_norm = by_row(functools.partial(jax.nn.logsumexp, axis=-1), invariant, penalized)
    top_logprobs, top_ids = jax.lax.top_k(penalized, num_top_logprobs)
    return (row_take(penalized, tokens) - log_norm, top_ids.astype(jnp.int32),
            top_logprobs - log_norm[:, None])


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "num_candidates", "needs",
                                             "invariant"))
def sample(
    logits, metadata: SamplingMetadata, output_counts, prompt_mask, rows=None,
    token_bitmask=None, *, num_top_logprobs: int = 0, num_candidates: int = NUM_CANDIDATES,
    needs: StepNeeds | None = None, prior_ids=None, invariant: bool = False,
) -> SampleOutput:
    """Picks one token per row from `logits` (f32/bf16[S, V]).

    `output_counts` (i32[S, V]) counts each token in the request's output so far and
    `prompt_mask` (bool[S, V]) marks the prompt's tokens; see `count_tokens` and `add_sampled`.
    With `rows`, they are per-slot tables indexed by `rows` (see `penalized_logits`).
    `token_bitmask` (i32[S, ceil(V/32)], optional) holds the tokens each row's grammar allows
    (`apply_token_bitmask`); a constrained row never picks another, greedy or sampled.
    `prior_ids`: see `penalized_logits`. `invariant` (--enable-deterministic-inference): the
    reductions over the vocabulary row by row (`by_row`).

    Work that no row of the batch needs is skipped: penalties, the random draw when every row is
    greedy, truncation when no row truncates, and logprobs when no row asks for them (zeros then;
    their log-normalizer and top-k over the vocabulary cost as much as the rest of the sampler at
    64 rows). `needs` (static, step_needs.py) says which parts the program has; None (the CPU's
    program) decides each at run time with a `lax.cond`.

    Logprobs (the chosen token's and the `num_top_logprobs` best) are log_softmax of the
    penalized logits: after bias, penalties and suppression, but before temperature and
    top_k/top_p/min_p, as vLLM reports them by default. So they describe the model's adjusted
    distribution rather than the truncated one sampled from, and a greedy row reports the same
    logprobs it would at temperature 1.
    """
    penalized = penalized_logits(logits, metadata, output_counts, prompt_mask, rows, token_bitmask,
                                 needs=needs, prior_ids=prior_ids)
    greedy = first_argmax(penalized)
    is_greedy = greedy_rows(metadata)
    tokens = only_if_needed(
        part(needs, "sampling"), lambda: ~jnp.all(is_greedy),
        lambda: jnp.where(is_greedy, greedy,
                          _draw(penalized, metadata, num_candidates, needs, invariant)),
        lambda: greedy)
    num_rows = logits.shape[0]
    skipped = (jnp.zeros(num_rows, jnp.float32), jnp.zeros((num_rows, num_top_logprobs), jnp.int32),
               jnp.zeros((num_rows, num_top_logprobs), jnp.float32))
    asked = jnp.any(metadata.return_logprob)

    def computed():
        # Zeros where no row asks, as the run-time program returns them ([S, N]: nothing to
        # speak of), so that a program computing logprobs for every step returns the same.
        return zeros_unless(asked, _logprobs(penalized, tokens, num_top_logprobs, invariant),
                            skipped)

    logprobs, top_ids, top_logprobs = only_if_needed(part(needs, "logprobs"), lambda: asked,
                                                     computed, lambda: skipped)
    return SampleOutput(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)
