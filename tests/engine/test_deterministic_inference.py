"""--enable-deterministic-inference (issue 75): the same 32 prompts alone, in batches of 2 to 64
mixed with other prompts (so chunked at other points by the prefill budget) and with the prefix
cache warm give bit-identical tokens and logprobs, greedy and seeded; without the flag the same
comparison differs (so the test can fail); what the mode does not cover is refused at start-up."""
import random

import pytest

from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.server_args import ServerArgs

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(1, 500) for _ in range(_rng.randrange(5, 60))] for _ in range(32)]
OTHERS = [[_rng.randrange(1, 500) for _ in range(_rng.randrange(5, 90))] for _ in range(32)]
SHARED = [_rng.randrange(1, 500) for _ in range(40)]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
# Chunks of 16 and a budget of 64 prompt tokens a step: a prompt alone is cut at multiples of 16,
# beside others wherever the budget runs out.
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, page_size=16, max_running_requests=64,
              context_length=256, max_total_tokens=64 * 256, chunked_prefill_size=16,
              max_prefill_tokens=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    make_tiny_checkpoint(directory, "llama")
    return directory


def _run(engine, prompts, params) -> list:
    results = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts),
                              return_logprob=True)
    return [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
            for r in results]


def _differences(engine, params) -> dict:
    """Rows whose tokens or logprobs differ from the prompt's run alone, per arrangement."""
    alone = [_run(engine, [p], params)[0] for p in PROMPTS]
    found = {}
    for size in (2, 8, 64):
        per_call = max(1, size // 2)
        mixed = []
        for i in range(0, len(PROMPTS), per_call):
            group = PROMPTS[i:i + per_call]
            mixed += _run(engine, group + OTHERS[:size - len(group)], params)[:len(group)]
        found[f"batch {size}"] = sum(a != b for a, b in zip(alone, mixed))
    engine.flush_cache()
    cold = [_run(engine, [SHARED + p], params)[0] for p in PROMPTS[:4]]
    _run(engine, [SHARED + [1, 2, 3]], params)  # the shared prefix cached
    warm = [_run(engine, [SHARED + p], params)[0] for p in PROMPTS[:4]]
    found["prefix cache"] = sum(a != b for a, b in zip(cold, warm))
    return found


def test_outputs_are_bit_identical_whatever_shares_the_steps(checkpoint):
    with Engine(checkpoint, enable_deterministic_inference=True, **ENGINE) as engine:
        for params in (GREEDY, SEEDED):
            assert _differences(engine, params) == {
                "batch 2": 0, "batch 8": 0, "batch 64": 0, "prefix cache": 0}, params


def test_without_the_flag_the_same_comparison_differs(checkpoint):
    with Engine(checkpoint, **ENGINE) as engine:
        found = _differences(engine, GREEDY)
    assert found["batch 8"] > 0 and found["batch 64"] > 0, found


@pytest.mark.parametrize("flags, named", [
    (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm"),
    (dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"]), "--enable-lora"),
    (dict(matmul_backend="xla"), "--matmul-backend xla"),
    (dict(attention_backend="reference"), "--attention-backend reference"),
])
def test_what_the_mode_does_not_cover_is_refused_by_name(flags, named):
    with pytest.raises(ValueError, match=f"--enable-deterministic-inference with {named}"):
        ServerArgs(enable_deterministic_inference=True, **flags)


def test_quantized_weights_and_experts_are_refused_at_start_up(tmp_path):
    moe = str(tmp_path / "moe")
    make_tiny_checkpoint(moe, "qwen3_moe")
    with pytest.raises(ValueError, match="mixture of experts is not built"):
        Engine(moe, enable_deterministic_inference=True, **ENGINE)
    with pytest.raises(ValueError, match="quantized weights"):
        Engine(None, enable_deterministic_inference=True, max_total_tokens=1024,
               context_length=256)
