"""The checks a model family's engine test makes (tests/engine/test_moe_engine.py,
tests/engine/test_gemma3_engine.py): batched, chunked greedy requests equal their solo runs and
transformers' tokens with nothing compiled after the precompile; a prompt that reuses cached pages
gives transformers' tokens; the same on two CPU devices in a process of their own."""
import json
import subprocess
import sys
import textwrap

import pytest

from tests.hf_reference import hf_greedy
from tests.tiny_models import make_tiny_checkpoint

# Greedy decoding of 10 tokens, end-of-sequence ignored: the families' requests.
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def family_fixtures(family: str, options: dict):
    """A test module's `checkpoint` (the tiny random `family` and transformers' model) and
    `engine` (an Engine on it with `options`) fixtures, both module-scoped: assign them to
    module names `checkpoint` and `engine`."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory):
        directory = str(tmp_path_factory.mktemp(family))
        return directory, make_tiny_checkpoint(directory, family)

    @pytest.fixture(scope="module")
    def engine(checkpoint):
        from xlaserve.offline import Engine

        with Engine(checkpoint[0], **options) as engine:
            yield engine

    return checkpoint, engine


def check_batched_equal_solo_and_transformers(engine, hf_model, prompts, greedy):
    compiles = engine.core.runner.compile_count()
    together = engine.generate(input_ids=prompts, sampling_params=greedy)
    new = greedy["max_new_tokens"]
    for prompt, result in zip(prompts, together, strict=True):
        solo = engine.generate(input_ids=prompt, sampling_params=greedy)
        assert result["output_ids"] == solo["output_ids"] == hf_greedy(hf_model, prompt, new)
    assert engine.core.runner.compile_count() == compiles


def check_cached_prefix(engine, hf_model, greedy):
    """Two prompts sharing 8 tokens (two pages of 4): the second's come from the cache."""
    engine.core.flush_cache()
    system = [5, 17, 300, 42, 9, 77, 120, 3]
    first = engine.generate(input_ids=system + [91, 13], sampling_params=greedy)
    second = engine.generate(input_ids=system + [400, 401, 402], sampling_params=greedy)
    assert [first["meta_info"]["cached_tokens"], second["meta_info"]["cached_tokens"]] == [0, 8]
    assert second["output_ids"] == hf_greedy(hf_model, system + [400, 401, 402],
                                             greedy["max_new_tokens"])


_TWO_DEVICES_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from xlaserve.offline import Engine

    assert len(jax.devices()) == 2, jax.devices()
    prompts, greedy, options = json.loads(sys.argv[2])
    with Engine(sys.argv[1], **options) as engine:
        compiles = engine.core.runner.compile_count()
        out = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert engine.core.runner.compile_count() == compiles, "compiled while serving"
    print(json.dumps([o["output_ids"] for o in out]))
""")


def check_two_devices(directory, hf_model, prompts, greedy, options: dict):
    """The batched greedy tokens of an Engine(directory, **options) on two CPU devices (a
    process of its own: the device count is fixed at JAX's start) are transformers' own, and
    only the precompiled steps ran."""
    result = subprocess.run(
        [sys.executable, "-c", _TWO_DEVICES_SCRIPT, directory,
         json.dumps([prompts, greedy, options])], capture_output=True, text=True, timeout=600,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
             "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error"})
    assert result.returncode == 0, result.stderr[-4000:]
    tokens = json.loads(result.stdout.strip().splitlines()[-1])
    assert tokens == [hf_greedy(hf_model, prompt, greedy["max_new_tokens"]) for prompt in prompts]
