"""The mixture-of-experts fields of ModelConfig (model_config.py) from a Hugging Face config:
Qwen2-MoE's and Qwen3-MoE's, Qwen3-Next's and Qwen3.5-MoE's, Mixtral's, gpt-oss's and DeepSeek-V2/V3's (Llama 4's are in
llama4_config.py); a router the code does not run refused in one line."""
from __future__ import annotations

from typing import Any


def experts_from_hf(hf_config: Any, architecture: str) -> dict:
    """The mixture-of-experts fields of a Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral,
    gpt-oss or DeepSeek-V2/V3 config ({} for others)."""
    num_layers = hf_config.num_hidden_layers
    if architecture == "Qwen3_5MoeForCausalLM":
        return _qwen3_5_experts(hf_config)
    if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return _deepseek_experts(hf_config, architecture == "DeepseekV3ForCausalLM")
    if architecture == "MixtralForCausalLM":
        # Every layer is sparse; the experts' width is `intermediate_size`; the top-k weights are
        # always renormalized.
        return dict(num_experts=hf_config.num_local_experts,
                    num_experts_per_tok=hf_config.num_experts_per_tok,
                    moe_intermediate_size=hf_config.intermediate_size, norm_topk_prob=True,
                    moe_layers=(True,) * num_layers)
    if architecture == "GptOssForCausalLM":
        # Every layer is sparse; the router's top k logits go through a softmax, which is the
        # softmax over all experts renormalized over the top k.
        return dict(num_experts=hf_config.num_local_experts,
                    num_experts_per_tok=hf_config.num_experts_per_tok,
                    moe_intermediate_size=hf_config.intermediate_size, norm_topk_prob=True,
                    moe_layers=(True,) * num_layers, attention_sinks=True, router_bias=True,
                    expert_bias=True, swiglu_limit=float(hf_config.swiglu_limit),
                    swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)))
    if architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"):
        return {}
    num_experts = hf_config.num_experts
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense_layers = set(getattr(hf_config, "mlp_only_layers", None) or ())
    # transformers' rule (Qwen2MoeDecoderLayer): a layer is sparse unless listed in
    # mlp_only_layers, when there are experts and (layer + 1) is a multiple of the step.
    moe_layers = tuple(i not in dense_layers and num_experts > 0 and (i + 1) % step == 0
                       for i in range(num_layers))
    # Qwen2-MoE's and Qwen3-Next's shared expert, gated; Qwen3-MoE has none.
    shared = (hf_config.shared_expert_intermediate_size
              if architecture in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM") else 0)
    return dict(num_experts=num_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                moe_intermediate_size=hf_config.moe_intermediate_size,
                norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
                shared_expert_intermediate_size=shared, moe_layers=moe_layers)


def _qwen3_5_experts(hf_config: Any) -> dict:
    """Qwen3.5-MoE's experts (transformers' Qwen3_5MoeSparseMoeBlock): every layer's MLP, routed
    by a softmax over all experts whose top k are always renormalized, beside a shared expert
    under its sigmoid gate. Its config has no decoder_sparse_step, mlp_only_layers or
    norm_topk_prob: one that sets them to anything else is refused, as is one without experts."""
    c, name = hf_config, "Qwen3_5MoeForCausalLM"
    if not c.num_experts:
        raise ValueError(f"{name} with num_experts {c.num_experts} is not supported: every "
                         "layer's MLP is its experts")
    if getattr(c, "mlp_only_layers", None) or (getattr(c, "decoder_sparse_step", 1) or 1) != 1:
        raise ValueError(f"{name} with mlp_only_layers or decoder_sparse_step is not supported: "
                         "every layer's MLP is its experts")
    if not getattr(c, "norm_topk_prob", True):
        raise ValueError(f"{name} with norm_topk_prob=False is not supported: its router "
                         "renormalizes the top k")
    return dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=True,
                shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                moe_layers=(True,) * c.num_hidden_layers)


def _deepseek_experts(hf_config: Any, v3: bool) -> dict:
    """DeepSeek-V2/V3's experts (Kimi K2 and Moonlight are V3): the first `first_k_dense_replace`
    layers dense, then every `moe_layer_freq`-th layer sparse (DeepSeek's own rule; every released
    checkpoint has 1); shared experts as one ungated MLP; the router (model/routing.py) by
    `scoring_func` and `topk_method`, refused where it is another than the code implements."""
    num_layers, num_experts = hf_config.num_hidden_layers, hf_config.n_routed_experts or 0
    first_sparse = getattr(hf_config, "first_k_dense_replace", 0) or 0
    every = getattr(hf_config, "moe_layer_freq", None) or 1
    scoring = getattr(hf_config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    method = getattr(hf_config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
    methods = {True: {"noaux_tc": "top2_sum"},
               False: {"greedy": None, "group_limited_greedy": "max"}}[v3]
    if method not in methods:
        raise ValueError(f"topk_method {method!r} is not supported for "
                         f"{'DeepSeek-V3' if v3 else 'DeepSeek-V2'} (supported: {', '.join(methods)})")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"scoring_func {scoring!r} is not supported with topk_method {method!r}")
    grouped = methods[method] is not None
    shared = (hf_config.n_shared_experts or 0) * hf_config.moe_intermediate_size
    return dict(
        num_experts=num_experts, num_experts_per_tok=hf_config.num_experts_per_tok or 0,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_expert_intermediate_size=shared, shared_expert_gate=False,
        moe_layers=tuple(num_experts > 0 and i >= first_sparse and i % every == 0
                         for i in range(num_layers)),
        router_scoring=scoring, router_groups=(hf_config.n_group or 1) if grouped else 1,
        router_topk_groups=(hf_config.topk_group or 1) if grouped else 1,
        router_group_score=methods[method] or "max", router_correction_bias=v3,
        routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0))
