"""Mixture-of-experts models (tiny random Qwen3-MoE and gpt-oss) through the engine: continuous
batching, chunked prefill and the prefix cache change which rows share a step and how many padding
rows it has, never a request's tokens; they stay transformers' greedy tokens, and nothing compiles
after the precompile; with --ep-size, too."""
import json
import subprocess
import sys
import textwrap

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


EXPERT_PARALLEL_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from xlaserve.offline import Engine

    assert len(jax.devices()) == 2, jax.devices()
    prompts, greedy, small = json.loads(sys.argv[2])
    with Engine(sys.argv[1], tp_size=2, ep_size=2, **small) as engine:
        compiles = engine.core.runner.compile_count()
        out = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert engine.core.runner.compile_count() == compiles, "compiled while serving"
    print(json.dumps([o["output_ids"] for o in out]))
""")


def test_expert_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2 --ep-size 2 on two CPU devices: four experts each, the batched and chunked
    greedy tokens still transformers' own, and the precompiled steps are the only ones. Over
    20 s: a process with two CPU devices starts JAX and precompiles the MoE's sharded steps."""
    result = subprocess.run(
        [sys.executable, "-c", EXPERT_PARALLEL_SCRIPT, checkpoint[0],
         json.dumps([PROMPTS, GREEDY, SMALL])], capture_output=True, text=True, timeout=600,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
             "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error"})
    assert result.returncode == 0, result.stderr[-4000:]
    tokens = json.loads(result.stdout.strip().splitlines()[-1])
    assert tokens == [hf_greedy(checkpoint[1], prompt, 10) for prompt in PROMPTS]
