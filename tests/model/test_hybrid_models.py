"""Hybrid linear-attention models (issue 76: Qwen3.5's text models, dense and MoE, and Qwen3-Next,
tiny random ones from tests/tiny_models.py: three Gated DeltaNet layers, then a gated
full-attention layer with RoPE on a quarter of each head) give transformers' logits at every
position, for prompts in one ragged step and in chunks of 3 beside other sequences' decoded
tokens, each sequence's linear layers on their own state slot; and their configs read as the
checkpoints mean them."""
import shutil

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.rope_config import partial_rope_rows
from xlaserve.model.weight_types.packed import PackedMatrix
from xlaserve.weights.loader import load_model
from xlaserve.weights.param_layout import SafetensorsSource, WeightError, convert

from tests.model.test_transformer_matches_transformers import (PROMPTS, _check_float32_logits,
                                                               pack_or_skip)
from tests.tiny_models import HYBRID, fuse_experts, tiny_decoder


@pytest.mark.parametrize("prefill_chunk,page_size,layout", [(64, 16, "xla"), (3, 4, "packed")],
                         ids=["one_ragged_batch-xla", "chunked_prefill_by_3-packed"])
@pytest.mark.parametrize("family", HYBRID)
def test_logits_match_transformers_for_ragged_batch_then_decode(hybrid_checkpoints, family,
                                                                prefill_chunk, page_size, layout):
    """Weights as loaded (XLA's dots), or packed for the CPU's native GEMM: the linear layers'
    projections and the output gate too."""
    directory, hf_model = hybrid_checkpoints[family]
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    assert loaded.config.state_layers == (0, 1, 2) and loaded.config.cache_layers == (3,)
    if layout == "packed":
        pack_or_skip(loaded)
        linear, full = loaded.model.layers[0].attn, loaded.model.layers[3].attn
        assert all(isinstance(weight.get_value(), PackedMatrix) for weight in (
            linear.in_proj_qkv, linear.in_proj_z, linear.in_proj_ba, linear.out_proj,
            full.output_gate))
    _check_float32_logits(loaded, hf_model, PROMPTS, prefill_chunk, page_size)


def _config(family: str, **overrides):
    spec = dict(HYBRID[family])
    config_class = getattr(transformers, spec.pop("cls"))
    architecture = spec.pop("architecture", config_class.__name__.replace("Config", "ForCausalLM"))
    shape = tiny_decoder(spec)
    return config_class(**{**shape, "vocab_size": 512, **spec, **overrides}), architecture


def test_qwen3_next_config_reads_its_linear_layers_experts_and_partial_rope():
    hf_config, architecture = _config("qwen3_next")
    config = ModelConfig.from_hf(hf_config, architecture)
    assert config.linear_layers == (True, True, True, False)
    assert config.linear_attention.conv_dim == 2 * 2 * 16 + 4 * 16
    assert config.attention_output_gate and config.qk_norm and config.norm_offset == 1.0
    assert config.num_experts == 4 and config.shared_expert_intermediate_size == 48
    assert config.rope.partial_rotary == 0.25
    inv_freq = config.rope_inv_freq()  # 4 of the 16 pairs rotate, at an 8-row head's rates
    assert len(inv_freq) == 16 and (inv_freq[4:] == 0).all()
    np.testing.assert_allclose(inv_freq[:4], 1e4 ** -(np.arange(0, 8, 2) / 8), rtol=1e-6)
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_qwen3_5_moe_config_reads_experts_in_every_layer_without_a_dense_mlp():
    """Qwen3.5-MoE's config has no intermediate_size, decoder_sparse_step, mlp_only_layers or
    norm_topk_prob: every layer's MLP is its experts, the top k renormalized, beside a gated
    shared expert."""
    hf_config, architecture = _config("qwen3_5_moe")
    assert not hasattr(hf_config, "intermediate_size")
    config = ModelConfig.from_hf(hf_config, architecture)
    assert config.linear_layers == (True, True, True, False) and config.intermediate_size == 0
    assert config.attention_output_gate and config.qk_norm and config.norm_offset == 1.0
    assert config.moe_layers == (True,) * 4 and config.num_experts == 4
    assert config.num_experts_per_tok == 2 and config.moe_intermediate_size == 32
    assert config.router.normalize and config.router.scoring == "softmax"
    assert config.shared_expert_intermediate_size == 48 and config.shared_expert_gate
    assert config.rope.partial_rotary == 0.25
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_qwen3_5_moe_experts_read_alike_from_one_tensor_each_or_all_in_two(hybrid_checkpoints,
                                                                           tmp_path):
    """transformers saves a tensor per expert; Qwen3.5-MoE's published files hold each layer's
    experts in two (`fuse_experts`): both give the same parameters, and a layer with neither
    stops the load naming both."""
    directory, _ = hybrid_checkpoints["qwen3_5_moe"]
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    fuse_experts(tmp_path)
    config = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(directory),
                                 "Qwen3_5MoeForCausalLM")
    per_expert = dict(convert(config, SafetensorsSource(directory)))
    fused = dict(convert(config, SafetensorsSource(str(tmp_path))))
    assert fused.keys() == per_expert.keys()
    assert per_expert[("layers", 3, "mlp", "experts_gate_up")].shape == (4, 64, 2, 32)
    for path in per_expert:
        np.testing.assert_array_equal(fused[path], per_expert[path], err_msg=str(path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.gate_up_proj"]
    (tmp_path / "neither").mkdir()
    save_file(tensors, str(tmp_path / "neither" / "model.safetensors"))
    experts = r"'model\.layers\.2\.mlp\.experts\."
    with pytest.raises(WeightError, match=rf"neither {experts}gate_up_proj' \(all experts\) nor "
                                          rf"{experts}0\.gate_proj\.weight'"):
        dict(convert(config, SafetensorsSource(str(tmp_path / "neither"))))


@pytest.mark.parametrize("family,overrides,message", [
    ("qwen3_5", dict(layer_types=["linear_attention", "sliding_attention"] * 2),
     "sliding_attention"),
    ("qwen3_5", dict(linear_conv_kernel_dim=1), "at least 2"),
    ("qwen3_5", dict(linear_num_value_heads=3), "multiple of linear_num_key_heads"),
    ("qwen3_5", dict(attention_bias=True), "attention_bias"),
    # Qwen3.5-MoE's experts: in every layer, renormalized.
    ("qwen3_5_moe", dict(num_experts=0), "num_experts 0"),
    ("qwen3_5_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen3_5_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
    ("qwen3_5_moe", dict(norm_topk_prob=False), "norm_topk_prob"),
])
def test_what_the_hybrid_layers_do_not_run_is_refused_by_name(family, overrides, message):
    hf_config, architecture = _config(family, **overrides)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf_config, architecture)


def test_partial_rope_rows_make_a_whole_head_rotation_transformers_partial_one():
    """Rows reordered by partial_rope_rows, rotated by halves of the whole head at the partial
    frequencies (zeros past them), are transformers' partial RoPE of the rows, reordered."""
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb
    import torch

    head_dim, rotated, position = 32, 8, 5.0
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 1, head_dim)).astype(np.float32)
    inv_freq = 1e4 ** -(np.arange(0, rotated, 2) / rotated)
    angles = np.concatenate([position * inv_freq] * 2)[None, None]
    theirs, _ = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k),
                                     torch.from_numpy(np.cos(angles).astype(np.float32)),
                                     torch.from_numpy(np.sin(angles).astype(np.float32)))
    order = partial_rope_rows(head_dim, rotated / head_dim)
    assert sorted(order) == list(range(head_dim))
    ours = q[..., order]
    freqs = np.concatenate([inv_freq, np.zeros(head_dim // 2 - rotated // 2)]) * position
    half = head_dim // 2
    x1, x2 = ours[..., :half], ours[..., half:]
    rotated_rows = np.concatenate([x1 * np.cos(freqs) - x2 * np.sin(freqs),
                                   x2 * np.cos(freqs) + x1 * np.sin(freqs)], axis=-1)
    np.testing.assert_allclose(rotated_rows, theirs.numpy()[..., order], rtol=1e-5, atol=1e-6)
