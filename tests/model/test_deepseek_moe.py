"""DeepSeek-V2/V3's mixture of experts (model/routing.py, model/moe.py): the router's sigmoid
scores, expert groups, choice bias and scale, the ungated shared experts and the dense first
layers, equal to transformers' DeepseekV2Moe / DeepseekV3MoE on the same weights."""
import importlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from xlaserve.runtime.executor.kernels import kernels_for
from xlaserve.model.config.experts_config import _deepseek_experts
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.rope_config import RopeConfig
from xlaserve.model.moe import MoE

HIDDEN, EXPERTS, INTER = 32, 16, 24


def _hf_config(version: str, **overrides):
    cls = getattr(transformers, f"Deepseek{version}Config")
    fields = dict(hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=INTER,
                  n_routed_experts=EXPERTS, num_experts_per_tok=4, n_shared_experts=2,
                  num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=64)
    if version == "V3":
        fields.update(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    return cls(**{**fields, **overrides})


def _config(hf, architecture: str) -> ModelConfig:
    return ModelConfig(architecture=architecture, vocab_size=64, hidden_size=HIDDEN,
                       intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=4,
                       head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(),
                       max_position_embeddings=128,
                       **_deepseek_experts(hf, architecture == "DeepseekV3ForCausalLM"))


def _torch_moe(hf, version: str, seed: int):
    torch.manual_seed(seed)
    modeling = importlib.import_module(
        f"transformers.models.deepseek_{version.lower()}.modeling_deepseek_{version.lower()}")
    module = getattr(modeling, "DeepseekV3MoE" if version == "V3" else "DeepseekV2Moe")(hf).float()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.2)
        if version == "V3":  # the choice's bias moves experts in and out of the top k
            module.gate.e_score_correction_bias.normal_(0, 0.1)
    return module


def _ours(module, config: ModelConfig) -> MoE:
    moe = MoE(config, jnp.float32, nnx.Rngs(0))
    as_np = lambda t: t.detach().numpy().astype(np.float32)  # noqa: E731
    gate_up = as_np(module.experts.gate_up_proj)  # [E, 2I, H]: gate rows, then up rows
    moe.router[...] = jnp.asarray(as_np(module.gate.weight).T)
    moe.experts_gate_up[...] = jnp.asarray(
        gate_up.reshape(EXPERTS, 2, INTER, HIDDEN).transpose(0, 3, 1, 2))
    moe.experts_down[...] = jnp.asarray(as_np(module.experts.down_proj).transpose(0, 2, 1))
    shared = module.shared_experts
    moe.shared_expert.gate_up[...] = jnp.asarray(np.stack(
        [as_np(shared.gate_proj.weight).T, as_np(shared.up_proj.weight).T], axis=1))
    moe.shared_expert.down[...] = jnp.asarray(as_np(shared.down_proj.weight).T)
    if config.router_correction_bias:
        moe.router_correction_bias[...] = jnp.asarray(as_np(module.gate.e_score_correction_bias))
    return moe


@pytest.mark.parametrize("version, overrides", [
    ("V3", {}),
    ("V3", {"norm_topk_prob": False, "n_group": 1, "topk_group": 1}),
    ("V2", {"topk_method": "greedy", "routed_scaling_factor": 16.0}),
    ("V2", {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}),
])
def test_the_experts_equal_transformers_deepseek_moe(version, overrides):
    hf = _hf_config(version, **overrides)
    architecture = f"Deepseek{version}ForCausalLM"
    config = _config(hf, architecture)
    assert config.moe_layers == (False, True, True, True)  # first_k_dense_replace=1
    assert config.shared_expert_intermediate_size == 2 * INTER and not config.shared_expert_gate
    module = _torch_moe(hf, version, seed=len(overrides))
    x = np.random.default_rng(0).normal(0, 1, (37, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)[None]).numpy()[0]
    got = np.asarray(_ours(module, config)(jnp.asarray(x), kernels_for("reference", None, "xla")))
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_a_router_the_code_does_not_implement_stops_the_config():
    with pytest.raises(ValueError, match="topk_method 'noaux' is not supported for DeepSeek-V3"):
        _deepseek_experts(_hf_config("V3", topk_method="noaux"), True)
    with pytest.raises(ValueError, match="scoring_func 'softmax' is not supported"):
        _deepseek_experts(_hf_config("V3", scoring_func="softmax"), True)
    with pytest.raises(ValueError, match="topk_group .* must be between 1 and n_group"):
        _config(_hf_config("V3", topk_group=5), "DeepseekV3ForCausalLM")
