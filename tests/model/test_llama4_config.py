"""Llama 4's configs read as the decoder's switches (model/config/llama4_config.py): Scout's
published text config (every layer MoE, every fourth NoPE, L2 q/k norms, llama3 RoPE scaling x16,
its chunk of 8192 on the RoPE layers) through its image checkpoint's top level, and Maverick's
differences (MoE every second layer, no q/k norms, 128 experts); Scout's vision encoder
(model/config/llama4_vision_config.py: 336-pixel tiles of 144 tokens); what is not run is
refused in one line. The logits: tests/model/test_transformer_matches_transformers.py (family
"llama4"), tests/vision/test_llama4_images.py (images)."""
import dataclasses

import pytest
import transformers

from xlaserve.model.config.encoder_config import model_config_from_hf
from xlaserve.model.config.model_config import ModelConfig

# meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json: its text_config (no_rope_layers
# left to the default interval of 4, as transformers 5 fills it), and the top level around it.
SCOUT_TEXT = dict(
    attention_bias=False, attention_chunk_size=8192, attn_scale=0.1, attn_temperature_tuning=True,
    bos_token_id=200000, eos_token_id=[200001, 200007, 200008], floor_scale=8192, head_dim=128,
    hidden_act="silu", hidden_size=5120, interleave_moe_layer_step=1, intermediate_size=8192,
    intermediate_size_mlp=16384, max_position_embeddings=10485760, num_attention_heads=40,
    num_experts_per_tok=1, num_hidden_layers=48, num_key_value_heads=8, num_local_experts=16,
    pad_token_id=200018, rms_norm_eps=1e-05, use_qk_norm=True, vocab_size=202048,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                     "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192})
# Its vision_config, as published.
SCOUT_VISION = dict(
    attention_dropout=0.0, hidden_act="gelu", hidden_size=1408, image_size=336,
    intermediate_size=5632, multi_modal_projector_bias=False, norm_eps=1e-05,
    num_attention_heads=16, num_channels=3, num_hidden_layers=34, patch_size=14,
    pixel_shuffle_ratio=0.5, projector_dropout=0.0, projector_input_dim=4096,
    projector_output_dim=4096, rope_theta=10000, vision_feature_select_strategy="default",
    vision_output_dim=4096)
SCOUT = dict(text_config=SCOUT_TEXT, vision_config=SCOUT_VISION, boi_token_index=200080,
             eoi_token_index=200081, image_token_index=200092, tie_word_embeddings=False)


def _scout(vision_changes=None, **text_changes) -> ModelConfig:
    config = transformers.Llama4Config(**dict(
        SCOUT, text_config={**SCOUT_TEXT, **text_changes},
        vision_config={**SCOUT_VISION, **(vision_changes or {})}))
    return model_config_from_hf(config, "Llama4ForConditionalGeneration")


def test_scout_reads_as_its_text_model_with_chunks_on_its_rope_layers():
    c = _scout()
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "Llama4ForConditionalGeneration", 48, 40, 8, 128)
    assert (c.intermediate_size, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        16384, 8192, 8192)
    assert c.moe_layers == (True,) * 48 and c.num_experts == 16
    assert (c.router_scoring, c.norm_topk_prob, c.num_experts_per_tok, c.shared_expert_gate,
            c.expert_input_scaled) == ("sigmoid", False, 1, False, True)
    assert c.nope_layers == tuple((i + 1) % 4 == 0 for i in range(48))
    assert c.qk_l2_norm and not c.qk_norm and c.rope_interleaved
    assert c.attention_temperature == (8192.0, 0.1)
    assert (c.rope.kind, c.rope.theta, c.rope.factor, c.rope.original_max_position_embeddings) \
        == ("llama3", 500000.0, 16.0, 8192)
    assert not c.tie_word_embeddings and c.eos_token_ids == (200001, 200007, 200008)
    # Chunked attention on the RoPE layers (every fourth layer is NoPE and global); no context cap.
    assert c.attention_chunks == tuple(None if (i + 1) % 4 == 0 else 8192 for i in range(48))


def test_scout_s_vision_encoder_makes_144_tokens_a_tile():
    v = _scout().vision
    assert (v.kind, v.depth, v.hidden_size, v.num_heads, v.head_dim) == ("llama4", 34, 1408, 16, 88)
    assert (v.image_size, v.patch_size, v.num_patches, v.patch_dim, v.shuffle) == (
        336, 14, 576, 588, 2)
    assert (v.tokens_per_tile, v.projector_dim, v.out_hidden_size, v.rope_theta) == (
        144, 4096, 5120, 10000.0)
    assert (v.image_token_id, v.boi_token_id, v.eoi_token_id) == (200092, 200080, 200081)
    assert ModelConfig.from_dict(_scout().to_dict()).vision == v


def test_maverick_interleaves_dense_layers_and_has_no_qk_norms():
    c = _scout(interleave_moe_layer_step=2, use_qk_norm=False, num_local_experts=128)
    assert c.moe_layers == tuple(i % 2 == 1 for i in range(48)) and c.num_experts == 128
    assert not c.qk_l2_norm


def test_what_is_not_run_is_refused_in_one_line():
    with pytest.raises(ValueError, match="num_experts_per_tok=2 is not supported"):
        _scout(num_experts_per_tok=2)
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        _scout(hidden_act="gelu")
    with pytest.raises(ValueError, match="a sliding window and an attention chunk on one layer"):
        dataclasses.replace(_scout(), sliding_windows=(4096,) * 48)
    for change, message in (
            ({"pixel_shuffle_ratio": 0.3}, "pixel_shuffle_ratio 0.3 is not 1 / n"),
            ({"intermediate_size": 4096}, "intermediate_size 4096 is not the shuffled patches' "
                                          "width 5632"),
            ({"vision_output_dim": 7680}, "vision_output_dim 7680 differ"),
            ({"image_size": 330}, "image_size 330 is not a whole number of 14-pixel patches"),
            ({"num_attention_heads": 64}, "a head must be a multiple of 4 wide")):
        with pytest.raises(ValueError, match="^Llama4ForConditionalGeneration: vision_config "
                                             f".*{message}"):
            _scout(change)
