"""Nemotron-H (issue 76: `NemotronHForCausalLM`, a tiny random one from tests/tiny_models.py:
Mamba-2 blocks, a NoPE attention block, ReLU^2 MLP blocks, an experts block, two Mamba-2 blocks
back to back) gives
transformers' logits at every position for prompts in chunks of 3 beside other sequences'
decoded tokens; its config reads as the checkpoint means it (single-mixer blocks paired into
mixer + feed-forward layers), and what the code does not run is refused by name."""
import types

import pytest
import transformers

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.sharding import check_split
from xlaserve.weights.loader import load_model

from tests.model.test_transformer_matches_transformers import PROMPTS, _check_float32_logits
from tests.tiny_models import NEMOTRON_H, make_tiny_checkpoint, tiny_decoder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("nemotron_h"))
    return directory, make_tiny_checkpoint(directory, "nemotron_h")


def test_logits_match_transformers_for_chunked_prompts_beside_decodes(checkpoint):
    directory, hf_model = checkpoint
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    assert loaded.config.state_layers == (0, 2, 3) and loaded.config.cache_layers == (1,)
    _check_float32_logits(loaded, hf_model, PROMPTS, prefill_chunk=3, page_size=4)


def _config(**overrides):
    spec = dict(NEMOTRON_H["nemotron_h"])
    spec.pop("cls")
    shape = tiny_decoder(spec)
    return transformers.NemotronHConfig(**{**shape, "vocab_size": 512, **spec, **overrides})


def test_config_pairs_blocks_into_layers_and_reads_the_mamba2_shapes():
    config = ModelConfig.from_hf(_config(), "NemotronHForCausalLM")
    assert config.nemotron_blocks == ((0, 1), (2, 3), (4, -1), (5, 6))
    assert config.linear_layers == (True, False, True, True) and config.num_layers == 4
    assert config.nope_layers == (True,) * 4 and config.activation == "relu2"
    m = config.mamba2
    assert (m.num_heads, m.head_dim, m.state_size, m.num_groups, m.conv_width) == (8, 8, 16, 2, 4)
    assert m.channels_per_group == 4 * 8 + 2 * 16 and m.conv_dim == 64 + 2 * 2 * 16
    assert m.time_step_limit == (0.0, float("inf")) and m.conv_bias
    assert config.moe_layers == (True, False, False, False) and config.num_experts == 8
    router = config.router
    assert (router.scoring, router.groups, router.topk_groups, router.group_score,
            router.correction_bias, router.scaling) == ("sigmoid", 2, 1, "top2_sum", True, 2.0)
    assert config.shared_expert_intermediate_size == 48 and not config.shared_expert_gate
    assert ModelConfig.from_dict(config.to_dict()) == config
    # the legacy pattern string reads the same
    pattern = _config(layers_block_type=None, hybrid_override_pattern="ME*-MM-")
    assert ModelConfig.from_hf(pattern, "NemotronHForCausalLM") == config


@pytest.mark.parametrize("overrides,message", [
    (dict(moe_latent_size=16), "moe_latent_size 16"),
    (dict(layers_block_type=["mlp", "linear_attention"]), "block 0 .mlp. has no mixer"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu'"),
    (dict(use_bias=True), "use_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(n_groups=3), "n_groups .3. must divide mamba_num_heads"),
])
def test_what_the_code_does_not_run_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_config(**overrides), "NemotronHForCausalLM")


def test_a_tensor_parallel_size_that_does_not_divide_the_groups_is_refused():
    config = ModelConfig.from_hf(_config(num_key_value_heads=4), "NemotronHForCausalLM")
    check_split(config, types.SimpleNamespace(shape={"tensor": 2}))
    with pytest.raises(ValueError, match="--tp-size 4 does not divide the Mamba-2 layers' 2 "
                                         "groups"):
        check_split(config, types.SimpleNamespace(shape={"tensor": 4}))
