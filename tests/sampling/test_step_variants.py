"""Static program variants (runtime/sampling/step_needs.py): the host's needs of a step, the variant it
picks, and that every variant covering a step samples the same tokens and logprobs as the
run-time program (lax.cond on the device), bit for bit."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.sampling.prompt_logprobs import NO_TARGET, prompt_logprobs
from xlaserve.runtime.sampling.sampler import sample
from xlaserve.runtime.sampling.params import build_sampling_metadata
from xlaserve.runtime.sampling.step_needs import (
    ACCELERATOR_VARIANTS,
    EVERYTHING,
    PLAIN,
    RUN_TIME,
    SAMPLED,
    StepNeeds,
    needs_of,
    program_needs,
)

S, V, TOP = 8, 1000, 5
GREEDY = RowSamplingParams(temperature=0.0, seed=0)


def _needs(rows, targets=(), grammar=False):
    metadata = build_sampling_metadata(rows, S)
    return needs_of(metadata, np.array(list(targets) or [NO_TARGET], np.int32), grammar)


def test_host_needs_name_exactly_the_parts_some_row_asks_for():
    assert _needs([GREEDY] * 3) == PLAIN
    # top_k 1 is greedy: no draw, so no truncation either.
    assert _needs([RowSamplingParams(temperature=0.8, top_k=1, top_p=0.5)]) == PLAIN
    # top_p on a greedy row truncates nothing that is sampled.
    assert _needs([RowSamplingParams(temperature=0.0, top_p=0.5)]) == PLAIN
    assert _needs([RowSamplingParams(temperature=0.7)]) == StepNeeds(sampling=True)
    assert _needs([GREEDY, RowSamplingParams(temperature=0.7, min_p=0.1)]) == StepNeeds(
        sampling=True, truncation=True)
    for penalty in ({"repetition_penalty": 1.1}, {"frequency_penalty": 0.5},
                    {"presence_penalty": -0.5}):
        assert _needs([RowSamplingParams(temperature=0.0, **penalty)]) == StepNeeds(penalties=True)
    assert _needs([RowSamplingParams(temperature=0.0, return_logprob=True)]) == StepNeeds(
        logprobs=True)
    assert _needs([GREEDY], targets=[NO_TARGET, 7]) == StepNeeds(prompt_logprobs=True)
    assert _needs([GREEDY], grammar=True) == StepNeeds(grammar=True)


def test_the_smallest_covering_variant_is_picked_and_run_time_stays_run_time():
    assert program_needs(PLAIN, ACCELERATOR_VARIANTS) == PLAIN
    assert program_needs(StepNeeds(logprobs=True), ACCELERATOR_VARIANTS) == SAMPLED
    assert program_needs(StepNeeds(grammar=True, sampling=True), ACCELERATOR_VARIANTS) == SAMPLED
    assert program_needs(StepNeeds(prompt_logprobs=True), ACCELERATOR_VARIANTS) == EVERYTHING
    assert program_needs(RUN_TIME, ACCELERATOR_VARIANTS) is RUN_TIME
    with pytest.raises(ValueError, match="no step variant covers"):
        program_needs(StepNeeds(penalties=True), (PLAIN,))


def _batch(rows, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(S, V)).astype(np.float32) * 3
    logits[0] *= 0.02  # flat: top_p 0.95 needs far more than the 4 candidates (exact search)
    counts = rng.integers(0, 3, (S, V)).astype(np.int32) * (rng.random((S, V)) < 0.05)
    prompt = rng.random((S, V)) < 0.02
    return logits, build_sampling_metadata(rows, S), counts, prompt


BATCHES = {
    "greedy": [GREEDY] * 3,
    "greedy with logprobs": [GREEDY, RowSamplingParams(temperature=0.0, return_logprob=True)],
    "sampled": [RowSamplingParams(temperature=0.9, top_p=0.95, seed=1, sample_index=3),
                RowSamplingParams(temperature=0.5, seed=2),
                RowSamplingParams(temperature=1.2, top_k=600, min_p=0.01, seed=3), GREEDY],
    "everything": [RowSamplingParams(temperature=0.9, top_p=0.95, seed=1, repetition_penalty=1.3,
                                     return_logprob=True),
                   RowSamplingParams(temperature=0.0, frequency_penalty=0.4, presence_penalty=0.2),
                   RowSamplingParams(temperature=0.7, top_k=3, seed=5, logit_bias={9: 4.0})],
}


@pytest.mark.parametrize("grammar", [False, True])
@pytest.mark.parametrize("name", list(BATCHES))
def test_each_covering_variant_samples_what_the_run_time_program_samples(name, grammar):
    logits, metadata, counts, prompt = _batch(BATCHES[name], seed=len(name))
    bitmask = np.full((S, -(-V // 32)), -1, np.int32)
    if grammar:
        bitmask[1, :10] = 0  # row 1 may not pick tokens 0-319
    needs = needs_of(metadata, np.array([NO_TARGET], np.int32), grammar)

    def run(step_needs):
        out = sample(logits, metadata, counts, prompt, None, bitmask, num_top_logprobs=TOP,
                     num_candidates=4, needs=step_needs)
        return jax.tree.map(np.asarray, out)

    expected = run(RUN_TIME)
    covering = [v for v in ACCELERATOR_VARIANTS if v.covers(needs)]
    assert covering[0] == program_needs(needs, ACCELERATOR_VARIANTS)
    for variant in covering + [dataclasses.replace(needs, grammar=grammar)]:
        got = run(variant)
        for field in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(got, field), getattr(expected, field),
                                          err_msg=f"{variant} {field}")
    if grammar:
        assert expected.tokens[1] >= 320


@pytest.mark.parametrize("with_targets", [False, True])
def test_prompt_logprobs_computed_branch_free_equal_the_run_time_ones(with_targets):
    rng = np.random.default_rng(0)
    rows, width, vocab = 40, 16, 64
    hidden = jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32))
    head = jnp.asarray(rng.normal(size=(width, vocab)).astype(np.float32))
    targets = np.full(rows, NO_TARGET, np.int32)
    if with_targets:
        targets[3:30] = rng.integers(0, vocab, 27)

    def run(needed):
        return jax.tree.map(np.asarray, prompt_logprobs(lambda h: h @ head, hidden,
                                                        jnp.asarray(targets), 4, needed))

    expected = run(None)
    for needed in [True] + ([] if with_targets else [False]):
        jax.tree.map(np.testing.assert_array_equal, run(needed), expected)
    assert np.any(expected.top_logprobs) == with_targets
