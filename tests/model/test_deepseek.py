"""DeepSeek-V2/V3 (issue 35): multi-head latent attention over a latent paged cache
(model/mla.py) with DeepSeek's experts (model/routing.py) gives transformers' logits, in one
ragged batch and in a chunked prefill, and its greedy continuation."""
import numpy as np
import pytest

from tests.model.test_transformer_matches_transformers import (PROMPTS, TOLERANCE, _hf_reference,
                                                               _run_ours)
from tests.tiny_models import DEEPSEEK
from xlaserve.weights.loader import load_model
from xlaserve.model.transformer import kv_cache_shape


CASES = {"one_ragged_batch": (64, 16, 0), "chunked_prefill_by_3": (3, 4, 0),
         "expanded_chunks_by_3": (3, 4, 1)}


@pytest.mark.parametrize("family,prefill_chunk,page_size,expanded_from", [
    pytest.param(family, *case, id=f"{name}-{family}")
    for name, case in CASES.items() for family in DEEPSEEK])
def test_deepseek_logits_match_transformers(deepseek_checkpoints, family, prefill_chunk,
                                            page_size, expanded_from):
    """`expanded_chunks_by_3`: every step in the expanded form (the cached prefix's part and the
    new tokens', merged), the first chunk's (no prefix) and the decode steps' too."""
    directory, hf_model = deepseek_checkpoints[family]
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    mla = loaded.config.mla
    # One latent row per token: kv_lora_rank + qk_rope_head_dim, not 2 x heads x head_dim.
    assert kv_cache_shape(loaded.config, 8, page_size, "cpu") == (8, page_size, 16 + 8)
    assert kv_cache_shape(loaded.config, 8, page_size, "tpu") == (8, page_size, 128)
    assert mla.rope_interleave and loaded.config.moe_layers == (False, True)
    references = [_hf_reference(hf_model, p) for p in PROMPTS]
    sequences = [(full, len(p)) for p, (full, _) in zip(PROMPTS, references, strict=True)]
    ours = _run_ours(loaded, sequences, prefill_chunk, page_size,
                     mla_expanded_prefill_tokens=expanded_from)
    for (full, expected), got in zip(references, ours, strict=True):
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)
        prompt_len = len(full) - 5
        assert got[prompt_len - 1:-1].argmax(-1).tolist() == full[prompt_len:]


@pytest.mark.parametrize("expanded_from", [0, 8], ids=["absorbed", "expanded"])
def test_the_engine_serves_deepseek_v3_as_transformers_generates(deepseek_checkpoints,
                                                                 expanded_from):
    """Through the serving step (chunked prefill of 8, the device page table, the prefix cache):
    greedy outputs equal transformers' generate; a prompt served again from the prefix cache
    gives the same tokens. `expanded`: --mla-expanded-prefill-tokens 8, so the 8-token buckets
    (the prefill chunks, a cached prefix behind all but the first) take the expanded form and
    the smaller decode ones the absorbed form."""
    import torch

    from xlaserve.offline import Engine

    directory, hf_model = deepseek_checkpoints["deepseek_v3"]
    prompts = [PROMPTS[0], PROMPTS[1], [7] * 20]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                          pad_token_id=0, eos_token_id=None)
        expected.append(generated[0, len(prompt):].tolist())
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(directory, skip_tokenizer_init=True, max_total_tokens=512,
                max_running_requests=4, chunked_prefill_size=8, max_prefill_tokens=8,
                mla_expanded_prefill_tokens=expanded_from) as engine:
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
        again = engine.generate(input_ids=[prompts[2]], sampling_params=greedy)[0]
    assert got == expected
    assert again["output_ids"] == expected[2] and again["meta_info"]["cached_tokens"] >= 16


def test_a_prompt_in_one_256_token_step_gives_the_absorbed_forms_logprobs_expanded(
        deepseek_checkpoints):
    """--mla-expanded-prefill-tokens 256 through the engine: a 250-token prompt's step (the
    256-token bucket) takes the expanded form, the native prefix kernel and the blocked new-token
    attention on CPU, and gives the absorbed form's prompt logprobs and tokens."""
    from xlaserve.offline import Engine

    directory, _ = deepseek_checkpoints["deepseek_v3"]
    prompt = [(7 * i) % 50 + 3 for i in range(250)]  # padded to the 256-token bucket
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outputs = {}
    for expanded_from in (256, 0):
        # Only the step sizes the prompt and its decodes take are compiled (each engine would
        # precompile every bucket otherwise: ~4x the time).
        with Engine(directory, skip_tokenizer_init=True, max_total_tokens=1024,
                    max_running_requests=4, mla_expanded_prefill_tokens=expanded_from,
                    disable_precompile=True) as engine:
            assert engine.core.runner.kernels.mla_expanded_prefill_tokens == expanded_from
            outputs[expanded_from] = engine.generate(
                input_ids=[prompt], sampling_params=greedy, return_logprob=True,
                logprob_start_len=0)[0]
    assert outputs[256]["output_ids"] == outputs[0]["output_ids"]
    logprobs = {given: [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
                for given, out in outputs.items()}
    np.testing.assert_allclose(logprobs[256], logprobs[0], atol=1e-4, rtol=0)


def test_a_negative_mla_expanded_prefill_tokens_is_refused():
    from xlaserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="--mla-expanded-prefill-tokens must be"):
        ServerArgs(mla_expanded_prefill_tokens=-1)
