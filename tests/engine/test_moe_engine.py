"""Mixture-of-experts models (tiny random Qwen3-MoE and gpt-oss) through the engine: continuous
batching, chunked prefill and the prefix cache change which rows share a step and how many padding
rows it has, never a request's tokens; they stay transformers' greedy tokens, and nothing compiles
after the precompile; with --ep-size, too (the checks: tests/engine/family_engine.py)."""
import pytest

from tests.engine.family_engine import (check_batched_equal_solo_and_transformers,
                                        check_cached_prefix, check_two_devices)
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine

PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13],
    [1, 2],
    [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417],
    [99],
    [33, 44, 55, 66],
]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=64, max_total_tokens=512)


# gpt-oss adds attention sinks and a sliding window (6 tokens, shorter than the prompts) in the
# CPU attention kernel, and expert biases under --ep-size.
@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def checkpoint(tmp_path_factory, request):
    directory = str(tmp_path_factory.mktemp(request.param))
    return directory, make_tiny_checkpoint(directory, request.param)


@pytest.fixture(scope="module")
def engine(checkpoint):
    with Engine(checkpoint[0], **SMALL) as engine:
        yield engine


def test_batched_chunked_greedy_requests_equal_solo_runs_and_transformers(engine, checkpoint):
    check_batched_equal_solo_and_transformers(engine, checkpoint[1], PROMPTS, GREEDY)


def test_a_prompt_that_reuses_cached_pages_gives_the_same_tokens(engine, checkpoint):
    check_cached_prefix(engine, checkpoint[1], GREEDY)


def test_expert_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2 --ep-size 2 on two CPU devices: four experts each, the batched and chunked
    greedy tokens still transformers' own, and the precompiled steps are the only ones. Over
    20 s: a process with two CPU devices starts JAX and precompiles the MoE's sharded steps."""
    check_two_devices(checkpoint[0], checkpoint[1], PROMPTS, GREEDY,
                      dict(SMALL, tp_size=2, ep_size=2))
