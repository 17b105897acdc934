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
    # the full layer's heads (global_head_dim, num_global_key_value_heads) and the sliding one's
    assert c.layer_heads == ((4, 16), (2, 32)) and (c.num_kv_heads, c.head_dim) == (4, 16)
    assert (c.layer(1).num_kv_heads, c.layer(1).head_dim, c.layer(1).queries_per_kv) == (2, 32, 2)
    assert c.layer(0) is c and c.widest_head_dim == 32
    assert c.rope_widths() == (16, 8)  # the full layers' table over 32 dims, the sliding's over 16
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert _config(attention_k_eq_v=False).value_is_key == (False, False)
    assert _config(final_logit_softcapping=None).final_logit_softcapping is None
    # "vision" concerns image tokens only (gemma4_vision_config.py): text stays causal
    assert _config(use_bidirectional_attention="vision") == c


def test_the_moe_block_reads_as_experts_beside_the_mlp():
    """enable_moe_block: every layer keeps its dense MLP (no moe_layers) and runs its experts
    beside it, top k renormalized (transformers' Gemma4TextRouter)."""
    c = _config(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    assert c.experts_beside_mlp and c.moe_layers == (False, False)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)
    assert c.router.normalize and c.router.scoring == "softmax"
    assert not _config().experts_beside_mlp and _config().num_experts == 0


def test_the_proportional_rope_equals_transformers():
    """The full layers' RoPE (transformers' default: "proportional", a quarter of the pairs
    rotating at theta 10^6, the rest not) and the sliding layers' (10^4) are transformers'."""
    hf = _hf(head_dim=32, global_head_dim=64)
    c = ModelConfig.from_hf(hf, "Gemma4ForCausalLM")
    assert (c.rope.kind, c.rope.rotary_fraction) == ("proportional", 0.25)
    rotary = transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding(hf)
    np.testing.assert_array_equal(c.rope.inv_freq(64), rotary.full_attention_inv_freq.numpy())
    np.testing.assert_array_equal(c.local_rope.inv_freq(32),
                                  rotary.sliding_attention_inv_freq.numpy())
    assert (c.rope.inv_freq(64)[8:] == 0).all() and (c.rope.inv_freq(64)[:8] > 0).all()
    # the step's rows: the full layers' table (32 pairs), then the sliding layers' (16)
    np.testing.assert_array_equal(c.rope_inv_freq(), np.concatenate(
        [rotary.full_attention_inv_freq.numpy(), rotary.sliding_attention_inv_freq.numpy()]))


@pytest.mark.parametrize("overrides,named", [
    (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=1024),
     "vocab_size_per_layer_input=1024 other than vocab_size=512"),
    (dict(num_kv_shared_layers=2, num_hidden_layers=3,
          layer_types=["sliding_attention", "full_attention", "full_attention"]),
     "leaves no earlier full_attention layer for layer 1"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=32),
     "enable_moe_block with num_experts=4 and top_k_experts=5"),
    (dict(final_logit_softcapping=0.0), "final_logit_softcapping=0.0"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
])
def test_what_the_decoder_does_not_run_is_refused_by_name(overrides, named):
    with pytest.raises(ValueError, match=named):
        _config(**overrides)


def test_per_layer_embeddings_and_shared_kv_read_as_their_fields():
    """gemma-4-e2b's form: per-layer inputs of 8, the last two of four layers reading the
    caches of the last earlier layer of their kind (no cache of their own), their MLPs twice as
    wide (use_double_wide_mlp)."""
    c = _config(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
                num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=False)
    assert c.per_layer_input_size == 8 and c.kv_source_layers == (0, 1, 0, 1)
    assert c.cache_layers == (0, 1) and [c.cache_slot(i) for i in range(4)] == [0, 1, 0, 1]
    assert [c.layer(i).intermediate_size for i in range(4)] == [128, 128, 256, 256]
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_transformers_default_config_reads():
    """Gemma4TextConfig()'s defaults (gemma-4-e2b's form: per-layer embeddings of 256, a full
    layer's head_dim 512 beside 256) read per layer."""
    c = ModelConfig.from_hf(transformers.Gemma4TextConfig(), "Gemma4ForCausalLM")
    assert c.per_layer_input_size == 256 and c.cache_layers == tuple(range(30))
    assert [c.layer(i).head_dim for i in range(6)] == [256] * 5 + [512]
    assert c.rope_widths() == (256, 128)


def test_lora_on_the_shared_key_and_value_projection_is_refused():
    """attention_k_eq_v: a k_proj adapter would move the values too, a v_proj one has no matrix."""
    from xlaserve.model.lora import LoraSpec, check_model

    for modules in (("k_proj",), ("v_proj",)):
        with pytest.raises(ValueError, match="attention_k_eq_v"):
            check_model(_config(), LoraSpec(1, 4, modules))
    check_model(_config(global_head_dim=16, num_global_key_value_heads=4),
                LoraSpec(1, 4, ("q_proj", "o_proj")))
    check_model(_config(attention_k_eq_v=False, global_head_dim=16,
                        num_global_key_value_heads=4), LoraSpec(1, 4, ("k_proj", "v_proj")))


def test_lora_on_attention_of_kv_shared_layers_is_refused():
    from xlaserve.model.lora import LoraSpec, check_model

    shared = _config(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                     num_kv_shared_layers=2, global_head_dim=16, num_global_key_value_heads=4)
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        check_model(shared, LoraSpec(1, 4, ("q_proj",)))
    check_model(shared, LoraSpec(1, 4, ("down_proj",)))


def test_lora_on_attention_whose_heads_differ_by_layer_is_refused():
    """The full layer's q/k/v/o differ in shape from the sliding one's: the slots are one shape."""
    from xlaserve.model.lora import LoraSpec, check_model

    with pytest.raises(ValueError, match="differ in head size or KV heads"):
        check_model(_config(), LoraSpec(1, 4, ("q_proj", "o_proj")))
    check_model(_config(), LoraSpec(1, 4, ("gate_proj", "up_proj", "down_proj")))
