"""Gemma 3's config as the published checkpoints give it (gemma-3-4b-it's text config: 5 local
layers to 1 global, rope_scaling linear x8 on the global ones, rope_local_base_freq on the local
ones) becomes the ModelConfig the decoder runs; what it does not run is refused in one line. No
model is built (the logits: tests/model/test_transformer_matches_transformers.py, family
"gemma3")."""
import dataclasses

import numpy as np
import pytest
import transformers

from xlaserve.model.config.model_config import ModelConfig

# google/gemma-3-4b-it's text_config, as its config.json gives it (transformers' older names).
GEMMA_3_4B_TEXT = dict(
    hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
    sliding_window_pattern=6, rope_scaling={"factor": 8.0, "rope_type": "linear"},
    rope_theta=1000000.0, rope_local_base_freq=10000.0, vocab_size=262208,
    max_position_embeddings=131072, rms_norm_eps=1e-6)


def _config(**overrides):
    return ModelConfig.from_hf(transformers.Gemma3TextConfig(**{**GEMMA_3_4B_TEXT, **overrides}),
                               "Gemma3ForCausalLM")


def test_the_published_text_config_reads_as_gemma_3():
    c = _config()
    local = [i for i, window in enumerate(c.sliding_windows) if window is not None]
    assert c.sliding_windows[5] is None and c.sliding_windows[0] == 1024
    assert len(local) == 29 and [c.rope_table(i) for i in range(6)] == [1, 1, 1, 1, 1, 0]
    assert (c.rope.theta, c.rope.kind, c.rope.factor) == (1e6, "linear", 8.0)
    assert (c.local_rope.theta, c.local_rope.kind) == (1e4, "default")
    assert c.rope_inv_freq().shape == (256,)  # both tables' 128 pairs side by side
    np.testing.assert_array_equal(c.rope_inv_freq()[128:], c.local_rope.inv_freq(256))
    assert c.softmax_scale == 256**-0.5 and c.embedding_multiplier == 2560**0.5
    assert (c.norm_offset, c.sandwich_norms, c.qk_norm, c.activation) == (1.0, True, True,
                                                                          "gelu_tanh")
    assert c.tie_word_embeddings and ModelConfig.from_dict(c.to_dict()) == c


def test_a_llama_keeps_one_rope_table():
    llama = ModelConfig.from_hf(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                                         num_hidden_layers=2), "LlamaForCausalLM")
    assert llama.local_rope is None and llama.rope_table(0) == 0
    np.testing.assert_array_equal(llama.rope_inv_freq(), llama.rope.inv_freq(llama.head_dim))
    assert llama.softmax_scale == llama.head_dim**-0.5


@pytest.mark.parametrize("overrides,named", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
])
def test_what_the_decoder_does_not_run_is_refused_by_name(overrides, named):
    with pytest.raises(ValueError, match=named):
        _config(**overrides)


def test_a_yarn_global_rope_beside_a_plain_local_one_is_refused():
    """One cos/sin scale a step (step_inputs.RopeTable): YaRN's on the global layers only is
    refused, not applied to both."""
    with pytest.raises(ValueError, match="attention factors differ"):
        c = _config()
        dataclasses.replace(c, rope=dataclasses.replace(c.rope, kind="yarn", factor=4.0))

