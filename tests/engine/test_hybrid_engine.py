"""Hybrid linear-attention models through the engine (issue 76: a tiny random Qwen3.5 text model,
tests/tiny_models.py): continuous batching with chunked prefill gives transformers' greedy tokens
and each request's solo ones, with nothing compiled after the precompile; more requests than
running slots, so later ones take the state slots of finished ones while others decode; a
repeated prefix is run again, not reused (prefix caching is off for these models, said at
start-up); on two devices (--tp-size 2) too; the flags whose state the linear layers do not keep
yet are refused by name. The checks: tests/engine/family_engine.py."""
import pytest

from tests.engine.family_engine import (GREEDY, check_batched_equal_solo_and_transformers,
                                        check_two_devices, family_fixtures)
from tests.hf_reference import hf_greedy
from xlaserve.offline import Engine

# Six requests on four running slots, prompts of 1 to 40 tokens in prefill chunks of 7.
PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13, 200, 201, 7, 8] * 2 + [1, 2, 3, 4],
    [1, 2],
    [(11 * i) % 500 + 1 for i in range(26)],
    [99],
    [400 + i for i in range(17)],
    [99, 98, 97, 96, 95],
]
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=7, max_prefill_tokens=12, context_length=96,
             max_total_tokens=512)

checkpoint, engine = family_fixtures("qwen3_5", SMALL)


def test_batched_chunked_greedy_requests_equal_solo_runs_and_transformers(engine, checkpoint):
    check_batched_equal_solo_and_transformers(engine, checkpoint[1], PROMPTS, GREEDY)


def test_a_repeated_prefix_runs_again_and_gives_transformers_tokens(engine, checkpoint):
    system = [5, 17, 300, 42, 9, 77, 120, 3]
    first = engine.generate(input_ids=system + [91, 13], sampling_params=GREEDY)
    second = engine.generate(input_ids=system + [400, 401, 402], sampling_params=GREEDY)
    assert [first["meta_info"]["cached_tokens"], second["meta_info"]["cached_tokens"]] == [0, 0]
    assert second["output_ids"] == hf_greedy(checkpoint[1], system + [400, 401, 402],
                                             GREEDY["max_new_tokens"])


def test_tensor_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2: the full layer split by KV head, its MLPs by width; the linear layers and
    their states whole on each device."""
    check_two_devices(checkpoint[0], checkpoint[1], PROMPTS, GREEDY, dict(SMALL, tp_size=2))


@pytest.mark.parametrize("flags,named", [
    (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm"),
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(enable_deterministic_inference=True), "--enable-deterministic-inference"),
])
def test_flags_the_linear_layers_do_not_keep_a_state_for_are_refused(checkpoint, flags, named):
    with pytest.raises(ValueError, match=f"{named}.* with a hybrid linear-attention model"):
        Engine(checkpoint[0], **SMALL, **flags)
