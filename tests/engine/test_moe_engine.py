"""A mixture-of-experts model (tiny random Qwen3-MoE) through the engine: continuous batching,
chunked prefill and the prefix cache change which rows share a step and how many padding rows it
has, never a request's tokens; they stay transformers' greedy tokens, and nothing compiles after
the precompile."""
import pytest

from tests.hf_reference import hf_greedy
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_moe"))
    return directory, make_tiny_checkpoint(directory, "qwen3_moe")


@pytest.fixture(scope="module")
def engine(checkpoint):
    with Engine(checkpoint[0], **SMALL) as engine:
        yield engine


def test_batched_chunked_greedy_requests_equal_solo_runs_and_transformers(engine, checkpoint):
    compiles = engine.core.runner.compile_count()
    together = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for prompt, result in zip(PROMPTS, together, strict=True):
        solo = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert result["output_ids"] == solo["output_ids"] == hf_greedy(checkpoint[1], prompt, 10)
    assert engine.core.runner.compile_count() == compiles


def test_a_prompt_that_reuses_cached_pages_gives_the_same_tokens(engine, checkpoint):
    engine.core.flush_cache()
    system = [5, 17, 300, 42, 9, 77, 120, 3]  # two whole pages of 4
    first = engine.generate(input_ids=system + [91, 13], sampling_params=GREEDY)
    second = engine.generate(input_ids=system + [400, 401, 402], sampling_params=GREEDY)
    assert [first["meta_info"]["cached_tokens"], second["meta_info"]["cached_tokens"]] == [0, 8]
    assert second["output_ids"] == hf_greedy(checkpoint[1], system + [400, 401, 402], 10)
