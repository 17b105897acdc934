"""Gemma 4's text config becomes the ModelConfig the decoder runs (model/config/gemma4_config.py);
what it does not run is refused in one line naming the field. No model is built (the logits:
tests/model/test_transformer_matches_transformers.py, family "gemma4"; the engine:
tests/engine/test_gemma4_engine.py)."""
import numpy as np
import pytest
import transformers

from tests.tiny_models import FAMILIES, TINY_DECODER
from xlaserve.model.config.model_config import ModelConfig


def _hf(**overrides):
    spec = {k: v for k, v in FAMILIES["gemma4"].items()
            if k not in ("cls", "architecture", "embedding_std")}
    return transformers.Gemma4TextConfig(**{**TINY_DECODER, "vocab_size": 512, **spec,
                                            **overrides})


def _config(**overrides):
    return ModelConfig.from_hf(_hf(**overrides), "Gemma4ForCausalLM")


def test_the_tiny_config_reads_as_gemma_4():
    c = _config()
    assert c.sliding_windows == (4, None) and [c.rope_table(i) for i in range(2)] == [1, 0]
    assert (c.norm_offset, c.sandwich_norms, c.qk_norm, c.value_norm, c.layer_scalars) == (
        0.0, True, True, True, True)
    assert c.softmax_scale == 1.0 and c.embedding_multiplier == 64**0.5
    assert c.activation == "gelu_tanh" and c.final_logit_softcapping == 1.5
    assert c.value_is_key == (False, True)  # attention_k_eq_v: the full layer's only
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert _config(attention_k_eq_v=False).value_is_key == (False, False)
    assert _config(final_logit_softcapping=None).final_logit_softcapping is None


def test_the_proportional_rope_equals_transformers():
    """The full layers' RoPE (transformers' default: "proportional", a quarter of the pairs
    rotating at theta 10^6, the rest not) and the sliding layers' (10^4) are transformers'."""
    hf = _hf(head_dim=32, global_head_dim=32)
    c = ModelConfig.from_hf(hf, "Gemma4ForCausalLM")
    assert (c.rope.kind, c.rope.rotary_fraction) == ("proportional", 0.25)
    rotary = transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding(hf)
    np.testing.assert_array_equal(c.rope.inv_freq(32), rotary.full_attention_inv_freq.numpy())
    np.testing.assert_array_equal(c.local_rope.inv_freq(32),
                                  rotary.sliding_attention_inv_freq.numpy())
    assert (c.rope.inv_freq(32)[4:] == 0).all() and (c.rope.inv_freq(32)[:4] > 0).all()


@pytest.mark.parametrize("overrides,named", [
    (dict(hidden_size_per_layer_input=8), "hidden_size_per_layer_input=8"),
    (dict(num_kv_shared_layers=1, num_hidden_layers=3,
          layer_types=["sliding_attention", "full_attention", "full_attention"]),
     "num_kv_shared_layers=1 > 0"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
     "enable_moe_block"),
    (dict(global_head_dim=32), "global_head_dim 32 other than head_dim 16"),
    (dict(num_global_key_value_heads=1),
     "num_global_key_value_heads 1 other than num_key_value_heads 2"),
    (dict(final_logit_softcapping=0.0), "final_logit_softcapping=0.0"),
    (dict(use_bidirectional_attention="vision"), "use_bidirectional_attention='vision'"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
])
def test_what_the_decoder_does_not_run_is_refused_by_name(overrides, named):
    with pytest.raises(ValueError, match=named):
        _config(**overrides)


def test_transformers_default_config_is_refused_for_its_per_layer_embeddings():
    """Gemma4TextConfig()'s defaults (gemma-4-e2b's form: per-layer embeddings of 256, a full
    layer's head_dim 512 beside 256) stop at the first field not run."""
    with pytest.raises(ValueError, match="hidden_size_per_layer_input=256"):
        ModelConfig.from_hf(transformers.Gemma4TextConfig(), "Gemma4ForCausalLM")
    with pytest.raises(ValueError, match="global_head_dim 512 other than head_dim 256"):
        ModelConfig.from_hf(transformers.Gemma4TextConfig(hidden_size_per_layer_input=0),
                            "Gemma4ForCausalLM")


def test_lora_on_the_shared_key_and_value_projection_is_refused():
    """attention_k_eq_v: a k_proj adapter would move the values too, a v_proj one has no matrix."""
    from xlaserve.model.lora import LoraSpec, check_model

    for modules in (("k_proj",), ("v_proj",)):
        with pytest.raises(ValueError, match="attention_k_eq_v"):
            check_model(_config(), LoraSpec(1, 4, modules))
    check_model(_config(), LoraSpec(1, 4, ("q_proj", "o_proj")))
    check_model(_config(attention_k_eq_v=False), LoraSpec(1, 4, ("k_proj", "v_proj")))
