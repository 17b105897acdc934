"""An engine serving with an FP8 KV cache (--kv-cache-dtype): twice the tokens of a bfloat16 pool
in the same memory, said at start-up; batched prompts and the prefix cache over FP8 pages; and
the quality it costs on the embedded default model (benchmarks/fp8_kv_quality.py: a fixed
English text's negative log-likelihood with the cache in the model's dtype, e4m3 and e5m2).

The default model's bounds: measured on 2026-11-28 (343 tokens, float32 activations), e4m3 added
0.017 nats a token (perplexity 30.82 -> 31.34) and kept 95.9% of the most likely next tokens,
e5m2 0.058 nats and 93.0%. The bounds are about three times the measured increase and a few
points under the agreement: a cache whose scale or decoding were wrong scores far worse (the
model's text turns to noise: several nats a token)."""
import logging

import jax.numpy as jnp
import pytest

from benchmarks.fp8_kv_quality import measure
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.rope_config import RopeConfig
from xlaserve.offline import Engine
from xlaserve.runtime.executor import kv_pool

BOUNDS = {"fp8_e4m3": (0.05, 0.92), "fp8_e5m2": (0.15, 0.88)}  # (NLL increase, top-1 agreement)


def test_the_default_model_scores_text_within_bounds_over_an_fp8_cache():
    results = measure()
    for kv_cache_dtype, (nll_increase, agreement) in BOUNDS.items():
        got = results[kv_cache_dtype]
        assert 0 < got["nll"] - results["auto"]["nll"] < nll_increase, results
        assert got["top1_agreement"] > agreement, results


def test_an_fp8_pool_holds_twice_the_tokens_of_bfloat16_in_the_same_memory(monkeypatch):
    config = ModelConfig("LlamaForCausalLM", vocab_size=512, hidden_size=256,
                         intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                         head_dim=32, rms_norm_eps=1e-6, rope=RopeConfig(),
                         max_position_embeddings=4096)
    monkeypatch.setattr(kv_pool, "device_memory", lambda device: (8 << 30, 1 << 30))
    pages = {dtype: kv_pool.num_pages_for(config, dtype, 16, max_total_tokens=None,
                                          mem_fraction_static=0.9)
             for dtype in (jnp.bfloat16, jnp.float8_e4m3fn)}
    assert pages[jnp.float8_e4m3fn] == 2 * pages[jnp.bfloat16]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    make_tiny_checkpoint(directory, "llama")
    return directory


def test_batched_prompts_and_the_prefix_cache_over_fp8_pages(checkpoint, caplog):
    prompts = [[5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13, 2, 4, 6],
               [400, 401, 402, 403], [99]]
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    options = dict(dtype="float32", skip_tokenizer_init=True, page_size=4,
                   max_running_requests=4, chunked_prefill_size=8, max_prefill_tokens=12,
                   precompile_token_paddings="4,16", context_length=64,
                   max_total_tokens=256)
    with caplog.at_level(logging.INFO):
        engine = Engine(checkpoint, kv_cache_dtype="fp8_e5m2", **options)
    with engine:
        assert engine.core.runner.kv_caches[0].dtype == jnp.float8_e5m2
        together = engine.generate(input_ids=prompts, sampling_params=greedy)
        alone = [engine.generate(input_ids=p, sampling_params=greedy) for p in prompts]
        assert [r["output_ids"] for r in together] == [r["output_ids"] for r in alone]
        # The second run of a prompt reads its prefix from FP8 pages the first one wrote.
        again = engine.generate(input_ids=prompts[0], sampling_params=greedy)
        assert again["meta_info"]["cached_tokens"] >= 12
        assert again["output_ids"] == alone[0]["output_ids"]
    assert ("KV cache dtype float8_e5m2 (--kv-cache-dtype fp8_e5m2): 256 tokens in 0.00 GB, "
            "where a float32 cache would hold 64") in caplog.text
