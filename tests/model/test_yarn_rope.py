"""YaRN RoPE scaling: frequencies and cos/sin scale as transformers computes them, and tiny YaRN
models whose logits and greedy tokens are transformers' past the original context length."""
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.executor.test_model_runner import _greedy_together
from tests.hf_reference import hf_greedy
from tests.model.test_transformer_matches_transformers import NEW_TOKENS, _hf_reference, _run_ours
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.runtime.executor.model_runner import ModelRunner
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.rope_config import RopeConfig
from xlaserve.weights.loader import load_model
from xlaserve.model.rope import rope_cos_sin

# (config class, its fields): published shapes with YaRN as their model cards enable it.
YARN_CONFIGS = {
    # Qwen3-8B with the model card's YaRN to 131072 tokens.
    "qwen3_factor4": (transformers.Qwen3Config, dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rope_theta=1e6, max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 32768})),
    # gpt-oss's RoPE: an un-truncated ramp (its ends not rounded to whole dimensions).
    "gpt_oss_like": (transformers.LlamaConfig, dict(
        hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        rope_theta=150000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False})),
    # An explicit cos/sin scale and other betas, on a mixture of experts.
    "explicit_attention_factor": (transformers.Qwen3MoeConfig, dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rope_theta=1e6, max_position_embeddings=262144, num_experts=8, num_experts_per_tok=2,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.3,
                      "beta_fast": 16.0, "beta_slow": 2.0,
                      "original_max_position_embeddings": 32768})),
    # DeepSeek's scale: the ratio of two mscales.
    "deepseek_mscale": (transformers.LlamaConfig, dict(
        hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=163840,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                      "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096})),
    # No factor: transformers takes max_position_embeddings / original_max_position_embeddings.
    "factor_from_lengths": (transformers.MistralConfig, dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=65536,
        rope_scaling={"rope_type": "yarn", "factor": None,
                      "original_max_position_embeddings": 8192})),
}


def _ours_and_transformers(name):
    config_class, fields = YARN_CONFIGS[name]
    hf_config = config_class(**fields)
    config = ModelConfig.from_hf(hf_config, config_class.__name__.replace("Config", "ForCausalLM"))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    return config, inv_freq.numpy(), attention_factor


@pytest.mark.parametrize("name", list(YARN_CONFIGS))
def test_yarn_frequencies_and_attention_factor_equal_transformers(name):
    config, expected_inv_freq, expected_factor = _ours_and_transformers(name)
    assert config.rope.kind == "yarn"
    inv_freq = config.rope.inv_freq(config.head_dim)
    assert inv_freq.dtype == np.float32
    # One float32 ulp: numpy's and torch's powf round theta ** (2i/d) differently at some i.
    np.testing.assert_allclose(inv_freq, expected_inv_freq, rtol=2.5e-7, atol=0)
    assert config.rope.attention_factor == pytest.approx(expected_factor, rel=1e-12)
    assert config.rope.attention_factor != 1.0


def test_yarn_host_cos_sin_equal_transformers_rotary_embedding():
    """The serving step's cos/sin (rope_cos_sin) are transformers' RotaryEmbedding output:
    the YaRN frequencies, times the attention factor."""
    config_class, fields = YARN_CONFIGS["qwen3_factor4"]
    hf_config = config_class(**fields)
    config = ModelConfig.from_hf(hf_config, "Qwen3ForCausalLM")
    positions = np.array([0, 1, 7, 100, 1000, 33000, 100000], np.int32)
    rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(hf_config)
    # Our frequencies in both, so that a one-ulp difference in them does not move large angles.
    rotary.inv_freq = torch.from_numpy(config.rope.inv_freq(config.head_dim))
    x = torch.zeros(1, len(positions), config.head_dim)
    expected = rotary(x, torch.from_numpy(positions[None].astype(np.int64)))
    half = config.head_dim // 2
    ours = rope_cos_sin(config.rope.inv_freq(config.head_dim), positions,
                        config.rope.attention_factor)
    for got, want in zip(ours, expected, strict=True):
        np.testing.assert_allclose(got, want[0, :, :half].numpy(), rtol=0, atol=3e-6)


def test_rope_config_round_trips_and_an_old_cache_entry_loads_unscaled():
    config, _, _ = _ours_and_transformers("explicit_attention_factor")
    assert ModelConfig.from_dict(config.to_dict()) == config
    # A conversion cache entry written before YaRN: its rope dict lacks the new fields.
    old = config.to_dict()
    old["rope"] = {"theta": 1e6, "kind": "default", "factor": 1.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert ModelConfig.from_dict(old).rope == RopeConfig(theta=1e6)
    assert ModelConfig.from_dict(old).rope.attention_factor == 1.0


@pytest.mark.parametrize("rope_scaling,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64,
      "original_max_position_embeddings": 4096}, "rope type 'longrope' is not supported"),
])
def test_unsupported_rope_scaling_is_refused_with_one_line(rope_scaling, message):
    hf_config = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8,
                                         max_position_embeddings=16384, rope_scaling=rope_scaling)
    with pytest.raises(ValueError, match=message) as error:
        ModelConfig.from_hf(hf_config, "LlamaForCausalLM")
    assert "\n" not in str(error.value)


# Tiny models whose original context (16) the prompts pass well beyond.
TINY_YARN = {
    "qwen3": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    # A wide, un-truncated ramp over head_dim 16 (pairs 0.21 to 3.41 blended).
    "llama": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 2.0, "beta_slow": 0.05,
              "truncate": False, "original_max_position_embeddings": 16},
}
LONG_PROMPT = [(37 * i + 11) % 500 for i in range(40)]


def _tiny_yarn(tmp_path, family):
    directory = str(tmp_path / family)
    hf_model = make_tiny_checkpoint(directory, family, rope_scaling=TINY_YARN[family],
                                    max_position_embeddings=64)
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    assert loaded.config.rope.kind == "yarn" and loaded.config.rope.attention_factor > 1.1
    return hf_model, loaded


def test_tiny_yarn_qwen3_logits_match_transformers_past_the_original_context(tmp_path):
    """The forward pass computing cos/sin itself (traced), prefill in chunks then decode."""
    hf_model, loaded = _tiny_yarn(tmp_path, "qwen3")
    prompts = [LONG_PROMPT, LONG_PROMPT[:5]]
    references = [_hf_reference(hf_model, p) for p in prompts]
    sequences = [(full, len(p)) for p, (full, _) in zip(prompts, references, strict=True)]
    ours = _run_ours(loaded, sequences, prefill_chunk=16, page_size=8)
    for (full, expected), got in zip(references, ours, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        prompt_len = len(full) - NEW_TOKENS
        assert got[prompt_len - 1:-1].argmax(-1).tolist() == full[prompt_len:]


def test_serving_step_of_tiny_yarn_llama_gives_transformers_greedy_tokens(tmp_path):
    """ModelRunner: cos/sin from the host (rope_cos_sin) and, where they build, the native CPU
    kernels (the QKV RoPE one takes cos/sin as inputs)."""
    hf_model, loaded = _tiny_yarn(tmp_path, "llama")
    prompts = [LONG_PROMPT[:22], LONG_PROMPT[30:33]]
    runner = ModelRunner(loaded, num_pages=1 + 8 * len(prompts), page_size=4,
                         max_running_requests=4)
    assert _greedy_together(runner, prompts, 6) == [hf_greedy(hf_model, p, 6) for p in prompts]
