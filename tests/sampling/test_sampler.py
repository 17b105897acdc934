"""The sampler against a NumPy reference of the same pipeline, parameter by parameter, plus
seeding (batch-independent, reproducible) and empirical distributions."""
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.runtime.sampling.params import RowSamplingParams, build_sampling_metadata
from xlaserve.runtime.sampling.sampler import (MASKED, add_sampled, count_tokens, first_argmax,
                                               penalized_logits, processed_logits, sample)

S, V = 8, 64  # the shape most tests share, so it compiles once


def random_logits(seed, rows=S, vocab=V, scale=3.0):
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32) * scale


def no_counts(rows=S, vocab=V):
    return np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), bool)


def run_sample(rows, logits, counts=None, prompt=None, num_top_logprobs=0, num_candidates=256):
    if counts is None:
        counts, prompt = no_counts(*logits.shape)
    metadata = build_sampling_metadata(rows, logits.shape[0])
    return sample(logits, metadata, counts, prompt, num_top_logprobs=num_top_logprobs,
                  num_candidates=num_candidates)


def run_pipeline(rows, logits, counts=None, prompt=None, num_candidates=256):
    """(penalized, processed) logits as NumPy arrays."""
    if counts is None:
        counts, prompt = no_counts(*logits.shape)
    metadata = build_sampling_metadata(rows, logits.shape[0])
    return (
        np.asarray(penalized_logits(logits, metadata, counts, prompt)),
        np.asarray(processed_logits(logits, metadata, counts, prompt, num_candidates=num_candidates)),
    )


# --- NumPy reference -----------------------------------------------------------------------


def np_penalized(logits, p: RowSamplingParams, counts, prompt):
    x = logits.astype(np.float64).copy()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    seen = prompt | (counts > 0)
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    x[list(p.suppressed_ids)] = -np.inf
    return x


def np_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def np_kept(penalized, p: RowSamplingParams):
    """bool[V]: tokens a sampling row may pick (random logits: no ties)."""
    scaled = penalized / p.temperature
    order = np.argsort(-scaled)
    keep = np.isfinite(scaled)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    if p.top_p < 1.0:
        probs = np_softmax(np.where(keep, scaled, -np.inf))[order]
        n = int(np.argmax(np.cumsum(probs) >= p.top_p)) + 1  # smallest prefix reaching top_p
        keep[order[n:]] = False
    probs = np_softmax(scaled)
    return keep & (probs >= p.min_p * probs.max())


def np_log_softmax(x):
    x = np.where(np.isfinite(x), x, -1e30)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


# --- penalties and bias ----------------------------------------------------------------------


def test_logit_bias_plus_100_forces_token_and_minus_100_forbids_it():
    logits = random_logits(0)
    logits[:, 3] = 20.0  # token 3 dominates every row
    forced = [RowSamplingParams(logit_bias={5: 100.0}, seed=1, sample_index=i) for i in range(4)]
    forbidden = [RowSamplingParams(logit_bias={3: -100.0}, seed=1, sample_index=i) for i in range(3)]
    greedy_forbidden = [RowSamplingParams(temperature=0.0, logit_bias={3: -100.0})]
    rows = forced + forbidden + greedy_forbidden
    tokens = np.asarray(run_sample(rows, logits).tokens)
    assert list(tokens[:4]) == [5] * 4
    assert 3 not in tokens[4:]
    assert tokens[7] == np.argsort(-logits[7])[1]  # the runner-up


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = random_logits(1)
    logits[0, :5] = [2.0, -2.0, 3.0, -1.0, 1.5]
    counts, prompt = no_counts()
    prompt[0, [0, 1]] = True  # prompt-only tokens
    counts[0, [2, 3]] = 1  # output-only tokens; token 4 is unseen
    prompt[1:] = np.random.default_rng(2).random((S - 1, V)) < 0.2
    counts[1:] = np.random.default_rng(3).integers(0, 2, (S - 1, V))
    rows = [RowSamplingParams(repetition_penalty=2.0)] + [
        RowSamplingParams(repetition_penalty=r) for r in np.linspace(0.5, 1.9, S - 1)
    ]
    penalized, _ = run_pipeline(rows, logits, counts, prompt)
    np.testing.assert_allclose(penalized[0, :5], [1.0, -4.0, 1.5, -2.0, 1.5])
    for i, p in enumerate(rows):
        np.testing.assert_allclose(penalized[i], np_penalized(logits[i], p, counts[i], prompt[i]), rtol=1e-6)


def test_frequency_and_presence_penalties_subtract_per_output_count_not_prompt():
    logits = random_logits(4)
    counts, prompt = no_counts()
    counts[:, 1], counts[:, 2] = 1, 3  # token 0 never generated
    prompt[:, 3] = True  # prompt tokens are not penalized by these two
    rows = [
        RowSamplingParams(frequency_penalty=f, presence_penalty=p)
        for f, p in [(0.5, 0.25), (0.0, 1.0), (1.0, 0.0), (-0.5, -2.0), (2.0, 2.0), (0, 0), (0.1, 0.3), (1.5, -1)]
    ]
    penalized, _ = run_pipeline(rows, logits, counts, prompt)
    np.testing.assert_allclose(penalized[0, :4] - logits[0, :4], [0.0, -0.75, -1.75, 0.0], atol=1e-6)
    for i, p in enumerate(rows):
        np.testing.assert_allclose(penalized[i], np_penalized(logits[i], p, counts[i], prompt[i]), rtol=1e-6)


def test_suppressed_ids_are_never_sampled_and_get_finite_masked_logprobs():
    logits = random_logits(5)
    logits[:, 7] = logits[:, 9] = 50.0
    rows = [RowSamplingParams(suppressed_ids=[7, 9], seed=3, sample_index=i) for i in range(S - 1)]
    rows.append(RowSamplingParams(temperature=0.0, suppressed_ids=[9, 7]))
    out = run_sample(rows, logits, num_top_logprobs=3)
    tokens = np.asarray(out.tokens)
    assert not set(tokens) & {7, 9}
    penalized, processed = run_pipeline(rows, logits)
    assert (penalized[:, [7, 9]] == MASKED).all() and (processed[:, [7, 9]] == MASKED).all()
    assert np.isfinite(np.asarray(out.top_logprobs)).all()
    assert not {7, 9} & set(np.asarray(out.top_ids).ravel())


# --- truncation ------------------------------------------------------------------------------

TRUNCATIONS = {
    "top_k": [dict(top_k=k) for k in (1, 2, 5, 10, 30, 63, 64, 100)],
    "top_p": [dict(top_p=p) for p in (0.05, 0.2, 0.5, 0.7, 0.9, 0.95, 0.99, 1.0)],
    "min_p": [dict(min_p=m) for m in (0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0)],
    "combined": [
        dict(top_k=10, top_p=0.8, min_p=0.05, temperature=0.7),
        dict(top_k=3, top_p=0.5, temperature=1.5),
        dict(top_p=0.9, min_p=0.1, temperature=0.3),
        dict(top_k=20, min_p=0.02, temperature=2.0),
        dict(top_k=40, top_p=0.95, min_p=0.0, temperature=0.9),
        dict(top_p=0.6, temperature=0.5, repetition_penalty=1.3, presence_penalty=0.5),
        dict(top_k=8, frequency_penalty=1.0, suppressed_ids=[0, 1, 2]),
        dict(min_p=0.2, logit_bias={4: 5.0}, temperature=1.2),
    ],
}


# num_candidates=V: every row takes the top-candidates fast path; 4: most rows need more than 4
# candidates and take the bisection path, in the same batch as rows that fit.
@pytest.mark.parametrize("num_candidates", [V, 4])
@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_truncation_keeps_the_same_tokens_as_numpy(name, num_candidates):
    logits = random_logits(6)
    counts = np.random.default_rng(7).integers(0, 3, (S, V)).astype(np.int32)
    prompt = np.random.default_rng(8).random((S, V)) < 0.1
    rows = [RowSamplingParams(**kwargs) for kwargs in TRUNCATIONS[name]]
    _, processed = run_pipeline(rows, logits, counts, prompt, num_candidates=num_candidates)
    for i, p in enumerate(rows):
        expected_penalized = np_penalized(logits[i], p, counts[i], prompt[i])
        keep = np_kept(expected_penalized, p)
        np.testing.assert_array_equal(processed[i] > MASKED, keep, err_msg=str(p))
        scaled = expected_penalized[keep] / p.temperature
        np.testing.assert_allclose(processed[i][keep], scaled, rtol=1e-5)


def test_tiny_temperature_keeps_masked_logits_finite():
    rows = [RowSamplingParams(temperature=1e-6, suppressed_ids=[1])] * S
    penalized, processed = run_pipeline(rows, random_logits(9))
    assert np.isfinite(processed).all() and processed.min() == MASKED


# --- greedy and logprobs ---------------------------------------------------------------------


def test_greedy_rows_take_argmax_of_penalized_logits():
    logits = random_logits(10)
    counts = np.random.default_rng(11).integers(0, 3, (S, V)).astype(np.int32)
    prompt = np.random.default_rng(12).random((S, V)) < 0.2
    rows = [RowSamplingParams(temperature=0.0, frequency_penalty=0.7, repetition_penalty=1.4)] * 4 + [
        RowSamplingParams(temperature=0.8, top_k=1, presence_penalty=1.0, seed=i) for i in range(4)
    ]
    tokens = np.asarray(run_sample(rows, logits, counts, prompt).tokens)
    for i, p in enumerate(rows):
        assert tokens[i] == np.argmax(np_penalized(logits[i], p, counts[i], prompt[i]))


def test_logprobs_equal_log_softmax_of_penalized_logits_and_top_logprobs_are_sorted():
    logits = random_logits(13)
    counts = np.random.default_rng(14).integers(0, 2, (S, V)).astype(np.int32)
    prompt = np.zeros((S, V), bool)
    rows = [
        RowSamplingParams(temperature=t, top_k=5, frequency_penalty=0.5, suppressed_ids=[2], seed=i,
                          return_logprob=i == 3)  # one row asking computes them for every row
        for i, t in enumerate([0.0, 0.3, 0.7, 1.0, 1.3, 2.0, 0.0, 1.0])
    ]
    out = run_sample(rows, logits, counts, prompt, num_top_logprobs=5)
    for i, p in enumerate(rows):
        expected = np_log_softmax(np_penalized(logits[i], p, counts[i], prompt[i]))
        token = int(out.tokens[i])
        np.testing.assert_allclose(float(out.logprobs[i]), expected[token], rtol=1e-5, atol=1e-5)
        best = np.argsort(-expected)[:5]
        np.testing.assert_array_equal(np.asarray(out.top_ids[i]), best)
        np.testing.assert_allclose(np.asarray(out.top_logprobs[i]), expected[best], rtol=1e-5, atol=1e-5)
        assert (np.diff(np.asarray(out.top_logprobs[i])) <= 0).all()


def test_logprobs_are_skipped_when_no_row_asks():
    rows = [RowSamplingParams(temperature=0.7, seed=i) for i in range(S)]
    out = run_sample(rows, random_logits(15), num_top_logprobs=5)
    assert not np.any(np.asarray(out.logprobs)) and not np.any(np.asarray(out.top_logprobs))
    asked = run_sample([RowSamplingParams(temperature=0.7, seed=i, return_logprob=True)
                        for i in range(S)], random_logits(15), num_top_logprobs=5)
    np.testing.assert_array_equal(np.asarray(asked.tokens), np.asarray(out.tokens))
    assert np.all(np.asarray(asked.logprobs) < 0)


@pytest.mark.parametrize("vocab", [64, 256, 1000])
def test_first_argmax_equals_argmax_with_ties_and_padding(vocab):
    x = random_logits(16, rows=6, vocab=vocab)
    x[1, [3, vocab - 1]] = 100.0  # a tie: the first index wins
    x[2, :] = -1e30  # all masked
    x[3, vocab - 1] = 100.0  # the maximum in the padded last block
    x[4, 0] = np.inf
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


# --- seeding ---------------------------------------------------------------------------------


def test_seeded_sampling_does_not_depend_on_batch_composition_or_row_index():
    request_logits = random_logits(15, rows=1, scale=1.0)[0]  # flat: many tokens are likely
    rng = np.random.default_rng(16)
    alone, in_batch = [], []
    for index in range(21):
        request = RowSamplingParams(temperature=0.9, top_p=0.95, seed=1234, sample_index=index)
        alone.append(int(run_sample([request], request_logits[None]).tokens[0]))
        others = [
            RowSamplingParams(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 9)),
                              seed=int(rng.integers(2**31)), sample_index=int(rng.integers(50)))
            for _ in range(S - 1)
        ]
        batch_logits = random_logits(100 + index)
        batch_logits[5] = request_logits
        in_batch.append(int(run_sample(others[:5] + [request] + others[5:], batch_logits).tokens[5]))
    assert alone == in_batch
    assert len(set(alone)) > 5  # the check means something: the tokens do vary


def test_same_seed_reproduces_and_different_seeds_give_different_sequences():
    logits = np.repeat(random_logits(17, rows=1, scale=0.5), S, axis=0)

    def sequence(seed):
        rows = [RowSamplingParams(seed=seed, sample_index=i) for i in range(S)]
        return list(np.asarray(run_sample(rows, logits).tokens))

    assert sequence(1) == sequence(1)
    assert sequence(1) != sequence(2)
    assert sequence(2**32 + 1) == sequence(1)  # seeds are taken mod 2**32


def test_rows_without_seed_get_distinct_random_seeds():
    rows = [RowSamplingParams()] * 4
    a, b = build_sampling_metadata(rows, 4), build_sampling_metadata(rows, 4)
    seeds = list(np.asarray(a.seeds)) + list(np.asarray(b.seeds))
    assert len(set(seeds)) == len(seeds)


# --- empirical distributions: 2000 rows of the same logits, one sample_index each ------------

N, SMALL_V = 2000, 8
SMALL_LOGITS = np.array([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.8], np.float32)


def empirical(num_candidates=256, **kwargs):
    rows = [RowSamplingParams(seed=7, sample_index=i, **kwargs) for i in range(N)]
    tokens = np.asarray(run_sample(rows, np.tile(SMALL_LOGITS, (N, 1)), num_candidates=num_candidates).tokens)
    return np.bincount(tokens, minlength=SMALL_V) / N


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_samples_follow_softmax_of_logits_over_temperature(temperature):
    expected = np_softmax(SMALL_LOGITS / temperature)
    assert 0.5 * np.abs(empirical(temperature=temperature) - expected).sum() < 0.05


@pytest.mark.parametrize("num_candidates", [256, 2])
@pytest.mark.parametrize("kwargs", [dict(top_k=3), dict(top_p=0.7), dict(min_p=0.3)])
def test_truncated_samples_come_from_kept_set_in_renormalized_proportions(kwargs, num_candidates):
    params = RowSamplingParams(**kwargs)
    keep = np_kept(SMALL_LOGITS.astype(np.float64), params)
    assert 1 < keep.sum() < SMALL_V
    expected = np.where(keep, np_softmax(SMALL_LOGITS), 0.0)
    expected /= expected.sum()
    observed = empirical(num_candidates=num_candidates, **kwargs)
    assert (observed[~keep] == 0).all()
    assert 0.5 * np.abs(observed - expected).sum() < 0.05


# --- penalty state, padding, builder ---------------------------------------------------------


def test_count_tokens_counts_live_entries_and_add_sampled_counts_live_rows():
    rng = np.random.default_rng(18)
    ids = rng.integers(-1, V, (S, 12)).astype(np.int32)  # -1 is padding
    lengths = rng.integers(0, 13, S).astype(np.int32)
    counts = np.asarray(count_tokens(jnp.asarray(ids), jnp.asarray(lengths), V))
    for i in range(S):
        live = ids[i, : lengths[i]]
        np.testing.assert_array_equal(counts[i], np.bincount(live[live >= 0], minlength=V))
    tokens = rng.integers(0, V, S).astype(np.int32)
    live = np.arange(S) % 2 == 0
    updated = np.asarray(add_sampled(jnp.asarray(counts), jnp.asarray(tokens), jnp.asarray(live)))
    expected = counts.copy()
    expected[np.arange(S)[live], tokens[live]] += 1
    np.testing.assert_array_equal(updated, expected)


def test_padding_rows_are_greedy_and_produce_no_nan():
    logits = random_logits(19)
    logits[3:] = 0.0
    rows = [RowSamplingParams(temperature=0.7, top_p=0.9, seed=1), RowSamplingParams(top_k=4), RowSamplingParams(min_p=0.1)]
    out = run_sample(rows, logits, num_top_logprobs=2)
    for field in (out.logprobs, out.top_logprobs):
        assert np.isfinite(np.asarray(field)).all()
    assert ((np.asarray(out.tokens) >= 0) & (np.asarray(out.tokens) < V)).all()
    _, processed = run_pipeline(rows, logits)
    assert np.isfinite(processed).all()


def test_builder_pads_rows_greedy_and_widths_to_powers_of_two():
    rows = [
        RowSamplingParams(logit_bias={1: 2.0, 5: -3.0, 9: 1.0}, suppressed_ids=[0, 1, 2, 3, 4], seed=5),
        RowSamplingParams(logit_bias={2: 1.0}, seed=6, sample_index=4),
    ]
    m = build_sampling_metadata(rows, 4)
    assert m.logit_bias_ids.shape == (4, 4) and m.suppressed_ids.shape == (4, 8)
    np.testing.assert_array_equal(np.asarray(m.logit_bias_ids[0]), [1, 5, 9, -1])
    np.testing.assert_array_equal(np.asarray(m.logit_bias_ids[2:]), -1)
    np.testing.assert_array_equal(np.asarray(m.temperature), [1.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(m.sample_index), [0, 4, 0, 0])
    assert list(np.asarray(m.seeds[:2])) == [5, 6]
    empty = build_sampling_metadata([RowSamplingParams()], 2)
    assert empty.logit_bias_ids.shape == (2, 1) and empty.suppressed_ids.shape == (2, 1)
