"""Tiny random Hugging Face checkpoints of each supported family."""

FAMILIES = {
    # Llama 3 style RoPE scaling, separate lm_head.
    "llama": dict(
        cls="LlamaConfig",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=256,
    ),
    # Linear RoPE scaling, tied embeddings.
    "llama_tied_linear": dict(
        cls="LlamaConfig", rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
    ),
    # q/k/v biases.
    "qwen2": dict(cls="Qwen2Config"),
    # per-head q/k RMSNorm, head_dim not hidden/heads.
    "qwen3": dict(cls="Qwen3Config", head_dim=32),
    # sliding window shorter than the prompts.
    "mistral": dict(cls="MistralConfig", sliding_window=6),
    # Mixtures of experts (model/moe.py). Qwen3-MoE: top 2 of 8, renormalized, qk norms.
    "qwen3_moe": dict(cls="Qwen3MoeConfig", head_dim=32, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True),
    # Qwen2-MoE: a shared expert with its sigmoid gate, top-k weights not renormalized, the second
    # layer dense (mlp_only_layers), q/k/v biases.
    "qwen2_moe": dict(cls="Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=96,
                      norm_topk_prob=False, mlp_only_layers=[1]),
    # Mixtral: experts as wide as intermediate_size, block_sparse_moe names, a sliding window.
    "mixtral": dict(cls="MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=6),
    # gpt-oss: attention sinks, sliding and full layers in turn, YaRN past 16 positions, biases on
    # attention, router and experts, the clamped SwiGLU with gate and up interleaved.
    "gpt_oss": dict(cls="GptOssConfig", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    intermediate_size=48, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 16},
                    max_position_embeddings=256),
    # Gemma 3: a sliding layer (window 4, shorter than the prompts; RoPE theta 10^4) and a full
    # one (10^6, linear x8), Gemma's norms (1 + weight, q/k, around both sublayers), embeddings
    # times sqrt(hidden), query_pre_attn_scalar other than head_dim, GeGLU, tied LM head.
    # Its embeddings 8x smaller, as the model scales them up by sqrt(64): otherwise each row's
    # own token dominates the tied LM head and greedy decoding repeats the last prompt token.
    "gemma3": dict(cls="Gemma3TextConfig", architecture="Gemma3ForCausalLM", head_dim=16,
                   embedding_std=0.0625,
                   query_pre_attn_scalar=24, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
    # Gemma 4's dense text model: a sliding layer (window 4, RoPE theta 10^4) and a full one
    # (transformers' default "proportional" RoPE: a quarter of the pairs rotate at theta 10^6),
    # the full layer's values its keys' projection (attention_k_eq_v), weightless value norms,
    # plain-weight norms, layer scalars (randomized), the softmax unscaled, logits soft-capped at
    # 1.5 (tanh bends the tiny model's logits, up to ~1.5). The full layer's heads as the
    # published checkpoints' are: twice as wide, half as many (global_head_dim 32, 2 KV heads
    # beside the sliding layer's 4 of 16: each layer's cache its own shape). Refused ones off: no
    # per-layer embeddings (transformers' default is on).
    "gemma4": dict(cls="Gemma4TextConfig", architecture="Gemma4ForCausalLM", head_dim=16,
                   num_key_value_heads=4, global_head_dim=32, num_global_key_value_heads=2,
                   hidden_size_per_layer_input=0, embedding_std=0.0625,
                   sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                   attention_k_eq_v=True, final_logit_softcapping=1.5),
    # Gemma 4's MoE block (gemma-4-26b-a4b's form): every layer's experts (top 2 of 4, GeGLU,
    # renormalized, each weight times its per-expert scale) beside its dense MLP, on the
    # residual stream, with their own norms; the rest as "gemma4".
    "gemma4_moe": dict(cls="Gemma4TextConfig", architecture="Gemma4ForCausalLM", head_dim=16,
                       num_key_value_heads=4, global_head_dim=32, num_global_key_value_heads=2,
                       hidden_size_per_layer_input=0, embedding_std=0.0625, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"],
                       attention_k_eq_v=True, final_logit_softcapping=1.5,
                       enable_moe_block=True, num_experts=4, top_k_experts=2,
                       moe_intermediate_size=32),
    # Gemma 4's small models' form (gemma-4-e2b, e4b): per-layer embeddings of 8 per layer, the
    # last two of four layers reading the KV caches of the first two (a sliding and a full one:
    # num_kv_shared_layers), their MLPs twice as wide (use_double_wide_mlp); no attention_k_eq_v.
    "gemma4_ple": dict(cls="Gemma4TextConfig", architecture="Gemma4ForCausalLM", head_dim=16,
                       num_hidden_layers=4, num_key_value_heads=4, global_head_dim=32,
                       num_global_key_value_heads=2, hidden_size_per_layer_input=8,
                       vocab_size_per_layer_input=512,
                       num_kv_shared_layers=2, use_double_wide_mlp=True, embedding_std=0.0625,
                       sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                       final_logit_softcapping=1.5),
    # Llama 4's text model: 4 layers, RoPE then NoPE (no_rope_layers), dense then MoE in each
    # (interleave_moe_layer_step 2: top 1 of 4 experts by sigmoid, a shared expert, the dense
    # MLPs wider), L2 q/k norms and chunked attention on the RoPE layers, temperature tuning on
    # the NoPE ones from position 3 (floor_scale 4), interleaved-pair RoPE with llama3 scaling.
    # Its attention chunk (32) is crossed by the tests' longer contexts (max_position_embeddings
    # 128): past position 31 a RoPE layer sees its own chunk alone.
    "llama4": dict(cls="Llama4TextConfig", architecture="Llama4ForCausalLM", head_dim=16,
                   num_hidden_layers=4, intermediate_size=48, intermediate_size_mlp=96,
                   num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                   no_rope_layers=[1, 1, 0, 0], attention_chunk_size=32, floor_scale=4,
                   attn_scale=0.1, max_position_embeddings=128,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
}

# DeepSeek-V2/V3 (model/mla.py, model/routing.py): multi-head latent attention (V3 with a query
# LoRA, V2 without), interleaved RoPE, YaRN with mscale; experts in groups, shared experts, the
# first layer dense. Not in FAMILIES: tests/model/test_deepseek.py runs them.


DEEPSEEK = {
    "deepseek_v3": dict(cls="DeepseekV3Config", num_key_value_heads=4, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
                        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                        topk_group=2, n_shared_experts=1, moe_intermediate_size=24,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "original_max_position_embeddings": 64},
                        max_position_embeddings=256),
    "deepseek_v2": dict(cls="DeepseekV2Config", num_key_value_heads=4, q_lora_rank=None,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
                        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                        topk_group=2, topk_method="group_limited_greedy", n_shared_experts=2,
                        moe_intermediate_size=24, first_k_dense_replace=1,
                        routed_scaling_factor=1.0),
}

# Hybrid linear-attention models (model/linear_attention.py, issue 76): three Gated DeltaNet
# layers (2 key heads of 16, 4 value heads of 16, a convolution 4 wide) then a gated full layer
# (RoPE on a quarter of its 32-row heads), (1 + weight) norms. Qwen3-Next's linear layers group
# their projections by key head, and its MLPs are experts (top 2 of 4) with a gated shared one;
# Qwen3.5-MoE's are too (renormalized), its config without intermediate_size (`absent`: no dense
# MLP), as the published ones. Not in FAMILIES: tests/model/test_hybrid_models.py runs them.
_HYBRID_LAYERS = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4,
                      layer_types=["linear_attention"] * 3 + ["full_attention"])
HYBRID = {
    "qwen3_5": dict(cls="Qwen3_5TextConfig", architecture="Qwen3_5ForCausalLM", **_HYBRID_LAYERS),
    "qwen3_next": dict(cls="Qwen3NextConfig", num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       **_HYBRID_LAYERS),
    "qwen3_5_moe": dict(cls="Qwen3_5MoeTextConfig", architecture="Qwen3_5MoeForCausalLM",
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, absent=("intermediate_size",),
                        **_HYBRID_LAYERS),
}

# Nemotron-H (model/mamba2.py, model/config/mamba2_config.py): Mamba-2 mixers (8 heads of 8 in
# 2 groups, a state of 16, a convolution 4 wide) and a NoPE attention block, each with a ReLU^2
# MLP block after it, or an experts block (the first: 8 ungated experts, top 2 from the best of
# 2 groups, weights times 2, a shared expert), two Mamba-2 blocks back to back (the first a layer
# without an MLP). Its config has no num_hidden_layers or rms_norm_eps (`absent`). Not in FAMILIES or HYBRID:
# tests/model/test_nemotron_h.py and tests/engine/test_nemotron_h_engine.py run it.
NEMOTRON_H = {
    "nemotron_h": dict(cls="NemotronHConfig", head_dim=16, mamba_num_heads=8, mamba_head_dim=8,
                       ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
                       layers_block_type=["linear_attention", "moe", "full_attention", "mlp",
                                          "linear_attention", "linear_attention", "mlp"],
                       n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
                       routed_scaling_factor=2.0,
                       absent=("num_hidden_layers", "rms_norm_eps")),
}

# Every family's decoder shape (make_tiny_checkpoint's, its vocab_size apart).
TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, rms_norm_eps=1e-6)


def tiny_decoder(spec: dict) -> dict:
    """TINY_DECODER but the fields the family's config has not (`spec`'s `absent`, popped)."""
    absent = spec.pop("absent", ())
    return {name: value for name, value in TINY_DECODER.items() if name not in absent}


def make_tiny_checkpoint(directory, family: str, dtype: str = "float32", seed: int = 0,
                         max_shard_size=None, vocab_size: int = 512, **config_overrides):
    """Save a random tiny model of `family` (2 layers, hidden 64, GQA 4:2, vocab 512) to `directory`;
    `config_overrides` change config fields (e.g. num_key_value_heads=4 to split over 4 devices).

    Every weight, bias and norm scale is randomized (transformers initializes biases to zero and
    norms to one, which would hide a missing bias or a misplaced norm)."""
    import torch
    import transformers

    spec = dict(FAMILIES.get(family) or DEEPSEEK.get(family) or NEMOTRON_H.get(family)
                or HYBRID[family])
    config_cls = getattr(transformers, spec.pop("cls"))
    architecture = spec.pop("architecture", config_cls.__name__.replace("Config", "ForCausalLM"))
    embedding_std = spec.pop("embedding_std", 0.5)
    shape = tiny_decoder(spec)
    config = config_cls(**{**shape, "vocab_size": vocab_size, **spec, **config_overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(model, embedding_std)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model.float().eval()


def fuse_experts(directory) -> None:
    """The checkpoint in `directory` (one model.safetensors, saved by transformers: a tensor per
    expert) rewritten with each layer's experts in two tensors, as Qwen3.5-MoE's published files
    hold them: `mlp.experts.gate_up_proj` [E, 2 * inter, hidden] (gate's rows, then up's) and
    `mlp.experts.down_proj` [E, hidden, inter]."""
    import re

    import numpy as np
    from safetensors.numpy import load_file, save_file

    path = f"{directory}/model.safetensors"
    tensors = load_file(path)
    experts = {}  # "...mlp.experts." -> {expert: {"gate" | "up" | "down": array}}
    for name in list(tensors):
        if match := re.fullmatch(r"(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name):
            prefix, expert, projection = match.groups()
            experts.setdefault(prefix, {}).setdefault(int(expert), {})[projection] = \
                tensors.pop(name)
    for prefix, by_expert in experts.items():
        ordered = [by_expert[expert] for expert in sorted(by_expert)]
        tensors[prefix + "gate_up_proj"] = np.stack([np.concatenate([e["gate"], e["up"]])
                                                     for e in ordered])
        tensors[prefix + "down_proj"] = np.stack([e["down"] for e in ordered])
    save_file(tensors, path, metadata={"format": "pt"})


def randomize(model, embedding_std: float = 0.5) -> None:
    """Every weight, bias and norm scale of `model` drawn at random (make_tiny_checkpoint's)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed" in name:
                param.copy_(embedding_std * torch.randn_like(param))
            elif name.endswith("sinks"):  # as large as the logits, so that they matter
                param.copy_(torch.randn_like(param))
            elif name.endswith("mlp.router.weight"):
                # gpt-oss: twice as decisive (at 0.5, half its positions had a near-tie).
                param.copy_(torch.randn_like(param))
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("router.proj.weight"):  # Gemma 4's: its input is / sqrt(hidden)
                param.copy_(8.0 * torch.randn_like(param))
            elif name.endswith(("mlp.gate.weight", "feed_forward.router.weight",
                                "mixer.gate.weight")):  # the last Nemotron-H's
                # Decisive routers (logits ~N(0, 4^2)): bfloat16 then picks the same experts as
                # float32 at most positions, which the bfloat16 test compares.
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: moves the choice
                buffer.copy_(0.1 * torch.randn_like(buffer))
            elif name.endswith("layer_scalar"):  # Gemma 4's (saved: a persistent buffer)
                buffer.copy_(1.0 + 0.3 * torch.randn_like(buffer))
            # Gemma 4's vision tower: its standardization (uninitialized until loaded), and
            # with use_clipped_linears its projections' bounds, tight enough to clip ~15% of
            # the normed inputs (~N(0, 1)) and of the outputs (~N(0, 0.45^2) at width 32).
            elif name.endswith("std_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
            elif name.endswith("std_scale"):
                buffer.copy_(1.0 + 0.2 * torch.randn_like(buffer))
            elif name.endswith(("input_min", "input_max")):
                buffer.copy_(torch.tensor(-1.5 if name.endswith("min") else 1.5))
            elif name.endswith(("output_min", "output_max")):
                buffer.copy_(torch.tensor(-0.6 if name.endswith("min") else 0.6))


def make_tiny_gemma3_conditional(directory, seed: int = 0, vision: dict | None = None,
                                 **overrides):
    """A tiny random Gemma3ForConditionalGeneration (gemma-3-4b-it's form) saved by transformers
    5 to `directory` (its tensors `language_model.model.*`, `vision_tower.*`,
    `multi_modal_projector.*`): FAMILIES["gemma3"]'s text model, a 2-layer SigLIP tower of width
    32 on 32-pixel images of 8-pixel patches, pooled to 4 image tokens (`vision`: other tower
    fields; `overrides`: Gemma3Config's, e.g. mm_tokens_per_image). Returns transformers'
    model (float32, eval)."""
    import transformers

    spec = dict(FAMILIES["gemma3"])
    for name in ("cls", "architecture", "embedding_std"):
        spec.pop(name)
    text = dict(TINY_DECODER, vocab_size=512, **spec)
    vision = dict(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, image_size=32, patch_size=8,
                       vision_use_head=False), **(vision or {}))
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, **{
        **dict(mm_tokens_per_image=4, boi_token_index=497, eoi_token_index=498,
               image_token_index=499, eos_token_id=[1, 106]), **overrides})
    return _saved_random(transformers.Gemma3ForConditionalGeneration, config, directory, seed,
                         FAMILIES["gemma3"]["embedding_std"])


def make_tiny_gemma4_conditional(directory, seed: int = 0, family: str = "gemma4",
                                 text: dict | None = None, vision: dict | None = None,
                                 **overrides):
    """A tiny random Gemma4ForConditionalGeneration (no audio tower) saved by transformers 5 to
    `directory` (its tensors `model.language_model.*`, `model.vision_tower.*`,
    `model.embed_vision.*`): FAMILIES[`family`]'s text model (`text`: other fields) and a
    1-layer vision tower of width 32 (`vision`: other fields; `overrides`: Gemma4Config's).
    Returns transformers' model (float32, eval)."""
    import transformers

    spec = dict(FAMILIES[family])
    for name in ("cls", "architecture", "embedding_std"):
        spec.pop(name)
    text = transformers.Gemma4TextConfig(**{**TINY_DECODER, "vocab_size": 512, **spec,
                                            **(text or {})})
    vision = transformers.Gemma4VisionConfig(**{
        **dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, head_dim=16), **(vision or {})})
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       **overrides)
    return _saved_random(transformers.Gemma4ForConditionalGeneration, config, directory, seed,
                         FAMILIES[family]["embedding_std"])


def make_tiny_llama4_conditional(directory, seed: int = 0):
    """A tiny random Llama4ForConditionalGeneration (Llama-4-Scout's form) saved by transformers 5
    to `directory` (its tensors `language_model.model.*`, `language_model.lm_head.*`,
    `vision_model.*`, `multi_modal_projector.*`): FAMILIES["llama4"]'s text model and a 2-layer
    vision encoder of width 32 (2 heads) on tiles of 32 pixels cut in 4-pixel patches (8 x 8),
    shuffled to 16 tokens a tile (Scout's ratio 0.5: its adapter takes 4 x 32 features). Returns
    transformers' model (float32, eval)."""
    import transformers

    spec = dict(FAMILIES["llama4"])
    for name in ("cls", "architecture"):
        spec.pop(name)
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=4, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5)
    config = transformers.Llama4Config(text_config=dict(TINY_DECODER, vocab_size=512, **spec),
                                       vision_config=vision, boi_token_index=497,
                                       eoi_token_index=498, image_token_index=499)
    return _saved_random(transformers.Llama4ForConditionalGeneration, config, directory, seed)


def _saved_random(model_class, config, directory, seed: int, embedding_std: float = 0.5):
    """`model_class(config)` (its architecture named in the config) with random weights
    (`randomize`), saved to `directory`; returned float32, eval."""
    import torch

    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config)
    randomize(model, embedding_std)
    model.save_pretrained(directory)
    return model.float().eval()
