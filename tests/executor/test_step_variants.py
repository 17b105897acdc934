"""The serving step's static program variants (runtime/sampling/step_needs.py) on the CPU, against the
CPU's own run-time program: the same tokens, logprobs and prompt logprobs step after step, the
variant each step picks, no conditional in any variant, and nothing compiled after precompile."""
import json

import jax
import numpy as np
import pytest

from tests.tiny_models import make_tiny_checkpoint
from xlaserve.runtime.executor.buckets import buckets_for_limits
from xlaserve.runtime.executor.forward_batch import make_forward_batch
from xlaserve.runtime.executor.model_runner import ModelRunner
from xlaserve.runtime.executor.step_inputs import staged_from_host
from xlaserve.runtime.executor.step_inputs import SAMPLING_WIDTHS, idle_step
from xlaserve.weights.loader import load_model
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.sampling.prompt_logprobs import NO_TARGET
from xlaserve.runtime.sampling.params import build_sampling_metadata
from xlaserve.runtime.sampling.step_needs import (
    ACCELERATOR_VARIANTS,
    EVERYTHING,
    PLAIN,
    RUN_TIME,
    SAMPLED,
)
from xlaserve.runtime.scheduler.request import SeqChunk

PAGE_SIZE = 4
BUCKETS = buckets_for_limits(max_tokens_per_step=16, max_seqs=4, max_pages_per_seq=8,
                             page_paddings=[8])
PROMPTS = [[5, 17, 300, 42, 9, 77, 120], [1, 2, 3]]
PAGES = [list(range(1, 9)), list(range(9, 17))]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_checkpoint(directory, "qwen3")
    return load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)


def _runner(loaded, static_variants):
    runner = ModelRunner(loaded, num_pages=17, page_size=PAGE_SIZE, max_running_requests=4,
                         static_variants=static_variants)
    for slot, prompt in enumerate(PROMPTS, start=1):
        runner.assign_slots([(slot, prompt, [7, 7, 8])])  # output ids, for the penalties
    return runner


def _steps(runner):
    """A prefill with prompt logprobs and a grammar mask, a plain greedy decode, a sampled decode
    with penalties and logprobs: each step's outputs and the program it picked."""
    bitmask = np.full((4, runner.bitmask_words), -1, np.int32)
    bitmask[0, :2] = 0  # the first row's grammar forbids tokens 0-63
    sampled = RowSamplingParams(temperature=0.9, top_p=0.5, top_k=40, seed=3, sample_index=1,
                                repetition_penalty=1.5, return_logprob=True)
    steps = [
        ([SeqChunk(PROMPTS[0], 0, PAGES[0], target_ids=PROMPTS[0][1:] + [NO_TARGET]),
          SeqChunk(PROMPTS[1], 0, PAGES[1])],
         [RowSamplingParams(temperature=0.0, seed=0)] * 2, bitmask),
        ([SeqChunk([11], 7, PAGES[0]), SeqChunk([12], 3, PAGES[1])],
         [RowSamplingParams(temperature=0.0, seed=0)] * 2, None),
        ([SeqChunk([13], 8, PAGES[0]), SeqChunk([14], 4, PAGES[1])],
         [sampled, RowSamplingParams(temperature=1.3, seed=4, frequency_penalty=0.7)], None),
    ]
    outputs, picked = [], []
    for chunks, rows, masks in steps:
        batch = make_forward_batch(chunks, BUCKETS, PAGE_SIZE)
        slots = np.zeros(batch.shape[1], np.int32)
        slots[:len(chunks)] = np.arange(1, len(chunks) + 1)
        staged = runner.stage(batch, build_sampling_metadata(rows, batch.shape[1],
                                                             SAMPLING_WIDTHS), slots)
        picked.append(runner._program_needs(staged.needs, masks is not None))
        outputs.append(jax.tree.map(np.asarray, runner.run(staged, masks)))
    assert outputs[0].sample.tokens[0] >= 64  # the grammar mask held
    return outputs, picked


def test_each_step_picks_the_smallest_variant_and_returns_what_the_run_time_program_does(loaded):
    run_time = _runner(loaded, static_variants=False)
    expected, picked = _steps(run_time)
    assert picked == [RUN_TIME] * 3
    static = _runner(loaded, static_variants=True)
    static.precompile(BUCKETS.all_shapes(), progress=False)
    compiled = static.compile_count()
    assert compiled == len(BUCKETS.all_shapes()) * len(ACCELERATOR_VARIANTS)
    got, picked = _steps(static)
    assert picked == [EVERYTHING, PLAIN, SAMPLED]
    assert static.compile_count() == compiled  # every step ran a precompiled program
    for step, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        for name, a, b in zip(("tokens", "logprobs", "top_ids", "top_logprobs", "prompt logprobs",
                               "prompt top ids", "prompt top logprobs"),
                              jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}: {name}")
    assert np.any(expected[0].prompt.logprobs) and np.any(expected[2].sample.logprobs)
    np.testing.assert_array_equal(np.asarray(static.output_counts),
                                  np.asarray(run_time.output_counts))


def _branches(runner, shape, needs) -> int:
    """The `lax.cond`s the step lowers to (StableHLO `case`s), before XLA's passes: XLA's CPU
    pipeline turns the tiny model's cheap branches into selects, so its optimised program has
    none either way."""
    args, kwargs = runner._lowering_args(shape, needs)
    return runner._step.lower(*args, **kwargs).as_text().count("stablehlo.case")


def test_no_variant_has_a_conditional_and_the_run_time_program_has_seven(loaded):
    runner = _runner(loaded, static_variants=True)
    shape = BUCKETS.all_shapes()[0]
    for needs in ACCELERATOR_VARIANTS:
        assert _branches(runner, shape, needs) == 0, needs
        assert " conditional(" not in runner.compiled_step(*shape, needs).as_text()
    # penalties, grammar, all greedy, truncation, exact thresholds, logprobs, prompt logprobs
    assert _branches(runner, shape, RUN_TIME) == 7


def test_a_followers_step_carries_the_leaders_needs_through_json(loaded):
    """Multi-host: the leader sends the staged step's needs (StepNeeds.as_list) in the step's JSON
    header; the follower's StagedStep has the same, so both processes run the same program."""
    runner = _runner(loaded, static_variants=True)
    shape = BUCKETS.all_shapes()[0]
    staged = runner.stage(*idle_step(*shape))
    vectors = [np.asarray(v) for v in (staged.ints, staged.floats, *staged.tables)]
    for needs in (SAMPLED, RUN_TIME):
        sent = json.loads(json.dumps(None if needs is None else needs.as_list()))
        follower = staged_from_host(runner, vectors, shape, staged.widths, sent)
        assert follower.needs == needs
