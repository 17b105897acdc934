"""ModelConfig: the few numbers and switches our decoder needs, read from a Hugging Face config.

Llama, Mistral, Qwen2 and Qwen3 differ only in switches (qkv bias, per-head q/k norm, sliding
window, tied embeddings, explicit head_dim), and Qwen2-MoE, Qwen3-MoE and Mixtral add experts in
place of some or all MLPs, so one frozen dataclass covers them. It is built from
`transformers`' config object so every field name quirk (missing `head_dim`, Qwen's
`layer_types`; RoPE's `rope_scaling` vs `rope_parameters` in rope_config.py) is resolved in
exactly one place.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from xlaserve.model.config.experts_config import experts_from_hf
from xlaserve.model.config.gemma4_config import GEMMA4_ARCHITECTURES, gemma4_fields
from xlaserve.model.config.gemma_config import GEMMA3_ARCHITECTURES, gemma3_fields
from xlaserve.model.config.layer_shapes import PerLayer
from xlaserve.model.config.linear_attention_config import (HYBRID_ARCHITECTURES,
                                                           LinearAttentionConfig, hybrid_fields)
from xlaserve.model.config.llama4_config import LLAMA4_ARCHITECTURES, llama4_fields
from xlaserve.model.config.mamba2_config import (NEMOTRON_H_ARCHITECTURES, Mamba2Config,
                                                 nemotron_h_fields)
from xlaserve.model.config.rope_config import RopeConfig, rope_from_hf, yarn_mscale
from xlaserve.model.config.vision_config import VisionConfig
from xlaserve.model.routing import RouterConfig


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int  # 0: the queries come from one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's RoPE'd rows are interleaved pairs (de-interleaved at load)
    softmax_scale: float

    @property
    def cache_width(self) -> int:
        """A token's row in the latent cache: the compressed KV, then the RoPE'd key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kernel_widths(self) -> tuple[int, int]:
        """(value_dim, row width) of the latent-attention kernels: the values are a row's
        compressed KV, the keys the whole row."""
        return self.kv_lora_rank, self.cache_width


def mla_from_hf(hf_config, v3: bool) -> MLAConfig:
    """DeepSeek-V2/V3's attention fields (V2 always rotates interleaved pairs; V3 says so in
    `rope_interleave`, true by default)."""
    nope, rope = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim {rope} is odd: RoPE rotates pairs")
    params = dict(getattr(hf_config, "rope_parameters", None) or
                  getattr(hf_config, "rope_scaling", None) or {})
    scale = (nope + rope) ** -0.5
    if (params.get("rope_type") or params.get("type") or "default") != "default":
        if mscale_all_dim := params.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
            scale *= yarn_mscale(params.get("factor") or 1.0, mscale_all_dim) ** 2
    return MLAConfig(q_lora_rank=hf_config.q_lora_rank or 0, kv_lora_rank=hf_config.kv_lora_rank,
                     qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                     v_head_dim=hf_config.v_head_dim,
                     rope_interleave=bool(getattr(hf_config, "rope_interleave", True)) if v3 else True,
                     softmax_scale=float(scale))


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """A BERT-family encoder's own fields (model/encoders/encoder.py): the embeddings' token types
    and position offset, the LayerNorms' epsilon, the MLP's GELU."""

    type_vocab_size: int
    layer_norm_eps: float
    # Position ids start here: XLM-RoBERTa's padding_idx + 1 (its ids count from past the
    # padding row), BERT's 0.
    position_offset: int
    activation: str  # "gelu" (erf) or "gelu_tanh"
    # ModernBERT (model/encoders/modernbert.py): RoPE's theta in the global and the local layers
    # (None: BERT's learned positions), each layer's kind (True: local), a local layer's keys at
    # most `local_window` positions away on either side, LayerNorms with a bias or not.
    rope_thetas: tuple[float, float] | None = None
    local_layers: tuple[bool, ...] = ()
    local_window: int = 0
    norm_bias: bool = True


# The encoders' architectures (model/encoders/encoder.py, model/encoders/modernbert.py; their
# configs: model/config/encoder_config.py).
ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "BertForSequenceClassification",
                         "XLMRobertaForSequenceClassification", "ModernBertModel")


@dataclasses.dataclass(frozen=True)
class ModelConfig(PerLayer):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # False: the model is built without an LM head: an embedding server's (nothing reads its
    # logits), so a checkpoint without lm_head.weight loads and one with it does not spend memory.
    lm_head: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # One entry per layer: the sliding window size, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    # One entry per layer: the attention chunk C (Llama 4's RoPE layers: a query at q sees the
    # keys k <= q with k // C == q // C), or None; never both a window and a chunk on a layer.
    attention_chunks: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (model/moe.py); num_experts == 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top k router weights to sum to one
    # The always-on expert every token runs (0: none): Qwen2-MoE's, scaled by a sigmoid gate;
    # DeepSeek's n_shared_experts as one MLP of their summed width, ungated.
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = True
    # DeepSeek's router (model/routing.py, RouterConfig): scores, groups, the choice's bias, the
    # weights' scale.
    router_scoring: str = "softmax"
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_score: str = "max"
    router_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    # One entry per layer: whether its MLP is the experts (decoder_sparse_step, mlp_only_layers).
    moe_layers: tuple[bool, ...] = ()
    # gpt-oss: a learned logit per query head in every softmax's denominator ("attention sinks"),
    # biases on the router and the experts, and a clamped SwiGLU (moe.py, clamped_swiglu).
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # None: the plain SwiGLU
    swiglu_alpha: float = 1.0
    # Multi-head latent attention (DeepSeek-V2/V3, model/mla.py); None: the usual attention.
    # `head_dim` is then the RoPE'd part's (the RoPE tables' width).
    mla: MLAConfig | None = None
    # A BERT-family encoder (model/encoders/encoder.py): bidirectional attention, no KV cache, no
    # RoPE (`rope` unused), post-LayerNorms of epsilon `encoder.layer_norm_eps`; None: a decoder.
    encoder: EncoderConfig | None = None
    # Every token attends to its whole input: an encoder's, or a decoder's run as one (vLLM's
    # --hf-overrides is_causal false: gte-Qwen2-7B-instruct). No KV cache, each input whole in
    # one step (an embedding server's alone).
    bidirectional: bool = False
    # A vision-language model's vision tower (model/vision/qwen_vision.py); None: text only.
    vision: VisionConfig | None = None
    # Gemma 3 (model/config/gemma_config.py): the sliding-window layers' own RoPE (None: `rope`
    # in every layer; `rope_table`), RMSNorms that multiply by `norm_offset` + their weight in
    # float32 (Gemma's 1 + weight), norms on attention's and the MLP's outputs before each
    # residual add (`sandwich_norms`), the token embeddings times `embedding_multiplier`
    # (rounded to the model dtype, as transformers does), the softmax scale (None:
    # head_dim ** -0.5; `softmax_scale`) and the gated MLP's activation ("silu" or "gelu_tanh").
    local_rope: RopeConfig | None = None
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embedding_multiplier: float = 1.0
    attention_scale: float | None = None
    activation: str = "silu"
    # Llama 4 (model/config/llama4_config.py): the router's weight multiplies the expert's input,
    # not its output (top 1 only); per layer, no RoPE (NoPE); weightless RMS norms of q and k
    # in the RoPE layers; the NoPE layers' queries scaled by log1p(floor((pos + 1) / floor_scale))
    # * attn_scale + 1 (`attention_temperature`: (floor_scale, attn_scale), None: unscaled); q's
    # and k's rows stored de-interleaved at load (the checkpoint's RoPE rotates interleaved
    # pairs); the RoPE layers' attention chunks are `attention_chunks`.
    expert_input_scaled: bool = False
    nope_layers: tuple[bool, ...] = ()
    qk_l2_norm: bool = False
    attention_temperature: tuple[float, float] | None = None
    rope_interleaved: bool = False
    # Gemma 4 (model/config/gemma4_config.py): a weightless RMS norm of the values; each layer's
    # output times its `layer_scalar` weight; logits soft-capped, tanh(l / c) * c (None: not);
    # per layer, values projected by k's weights (attention_k_eq_v; v = k_proj at load).
    value_norm: bool = False
    layer_scalars: bool = False
    final_logit_softcapping: float | None = None
    value_is_key: tuple[bool, ...] = ()
    # Per layer, (num_kv_heads, head_dim) where layers differ (Gemma 4's full layers: wider heads,
    # fewer of them); () every layer the fields'. A layer is built from `layer(i)`, its cache too
    # (runtime/executor/kv_pool.py: one array per layer, each its own shape).
    layer_heads: tuple[tuple[int, int], ...] = ()
    # Per layer, its MLP's width where layers differ (Gemma 4's use_double_wide_mlp: the KV-shared
    # layers' twice intermediate_size); () every layer intermediate_size.
    layer_intermediate: tuple[int, ...] = ()
    # Per layer, the layer whose KV cache its attention reads: itself, or for Gemma 4's KV-shared
    # layers (num_kv_shared_layers) an earlier one's, with no cache of its own (`cache_layers`).
    kv_source_layers: tuple[int, ...] = ()
    # Per layer, how many copies of each of the checkpoint's KV heads its attention holds (1: as
    # stored): more devices than KV heads (`replicate_kv_heads`, layer_shapes.py); () all 1.
    kv_replicas: tuple[int, ...] = ()
    # Gemma 4's per-layer embeddings (PLE, model/per_layer_inputs.py): each layer's input of this
    # width, from the token's own table row and a projection of its embedding; 0: none.
    per_layer_input_size: int = 0
    # Gemma 4's MoE block: every layer runs its experts beside its dense MLP
    # (model/moe.ExpertsBesideMlp), moe_layers all False.
    experts_beside_mlp: bool = False
    # Per layer, an FP8 KV cache's (k_scale, v_scale) as the checkpoint gives them
    # (model/fp8_kv_cache.py, weights/kv_scales.py); None: 1.0 each. A cache in the model's
    # dtype does not read them.
    kv_scales: tuple[tuple[float, float], ...] | None = None
    # Hybrid linear-attention models (Qwen3.5, Qwen3-Next: linear_attention_config.py): the
    # Gated DeltaNet layers' shapes (None: every layer attends), which layers they are (a
    # per-request state each, no KV cache: `state_layers`), and the full layers' sigmoid gate on
    # attention's output (q_proj's second half of each head).
    linear_attention: LinearAttentionConfig | None = None
    linear_layers: tuple[bool, ...] = ()
    attention_output_gate: bool = False
    # Nemotron-H (mamba2_config.py): its linear layers Mamba-2 mixers of these shapes
    # (model/mamba2.py; None: Gated DeltaNet's), and per layer the checkpoint's (mixer block,
    # MLP block or -1: a layer without an MLP) of its single-mixer blocks.
    mamba2: Mamba2Config | None = None
    nemotron_blocks: tuple[tuple[int, int], ...] = ()

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if len(self.sliding_windows) != self.num_layers:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.attention_chunks) != self.num_layers:
            object.__setattr__(self, "attention_chunks", (None,) * self.num_layers)
        if any(w and c for w, c in zip(self.sliding_windows, self.attention_chunks)):
            raise ValueError("a sliding window and an attention chunk on one layer are not "
                             "supported")
        if len(self.nope_layers) != self.num_layers:
            object.__setattr__(self, "nope_layers", (False,) * self.num_layers)
        if len(self.value_is_key) != self.num_layers:
            object.__setattr__(self, "value_is_key", (False,) * self.num_layers)
        if len(self.linear_layers) != self.num_layers:
            object.__setattr__(self, "linear_layers", (False,) * self.num_layers)
        if any(self.linear_layers) and (self.linear_attention is None) == (self.mamba2 is None):
            raise ValueError("linear_layers need one of linear_attention's or mamba2's shapes")
        if self.rope.partial_rotary != 1.0 and (self.rope_interleaved or self.mla is not None):
            raise ValueError("partial_rotary_factor with interleaved-pair RoPE is not supported")
        self._check_layers()
        if self.expert_input_scaled and self.num_experts_per_tok != 1:
            raise ValueError("router weights scaling the experts' inputs need top-1 routing "
                             f"(num_experts_per_tok is {self.num_experts_per_tok})")
        if len(self.moe_layers) != self.num_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
        if self.intermediate_size < 1 and not all(self.moe_layers):
            raise ValueError("intermediate_size is missing, and not every layer's MLP is experts")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                             f"and num_experts ({self.num_experts})")
        if self.num_experts and self.num_experts % self.router_groups:
            raise ValueError(f"n_group ({self.router_groups}) must divide the number of experts "
                             f"({self.num_experts})")
        if self.num_experts:
            self.router  # checks its fields
        if self.local_rope is not None and \
                self.local_rope.attention_factor != self.rope.attention_factor:
            raise ValueError("RoPE scalings whose attention factors differ between sliding and "
                             "full layers are not supported")

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(
            top_k=self.num_experts_per_tok, normalize=self.norm_topk_prob,
            scoring=self.router_scoring, groups=self.router_groups,
            topk_groups=self.router_topk_groups, group_score=self.router_group_score,
            correction_bias=self.router_correction_bias, scaling=self.routed_scaling_factor)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        data = dict(data)
        for name in ("rope", "local_rope"):
            if data.get(name) is not None:
                rope = dict(data[name])
                rope["mrope_section"] = tuple(rope.get("mrope_section", ()))
                data[name] = RopeConfig(**rope)
        data["vision"] = VisionConfig.from_dict(data["vision"]) if data.get("vision") else None
        data["sliding_windows"] = tuple(data["sliding_windows"])
        data["attention_chunks"] = tuple(data.get("attention_chunks", ()))
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        data["moe_layers"] = tuple(data.get("moe_layers", ()))
        data["nope_layers"] = tuple(data.get("nope_layers", ()))
        data["value_is_key"] = tuple(data.get("value_is_key", ()))
        data["layer_heads"] = tuple(tuple(one) for one in data.get("layer_heads", ()))
        data["layer_intermediate"] = tuple(data.get("layer_intermediate", ()))
        data["kv_source_layers"] = tuple(data.get("kv_source_layers", ()))
        data["kv_replicas"] = tuple(data.get("kv_replicas", ()))
        if data.get("attention_temperature") is not None:
            data["attention_temperature"] = tuple(data["attention_temperature"])
        data["mla"] = MLAConfig(**data["mla"]) if data.get("mla") else None
        data["linear_layers"] = tuple(data.get("linear_layers", ()))
        data["linear_attention"] = (LinearAttentionConfig(**data["linear_attention"])
                                    if data.get("linear_attention") else None)
        if data.get("mamba2"):
            data["mamba2"] = Mamba2Config(**dict(
                data["mamba2"], time_step_limit=tuple(data["mamba2"]["time_step_limit"])))
        data["nemotron_blocks"] = tuple(tuple(b) for b in data.get("nemotron_blocks", ()))
        if data.get("encoder"):
            encoder = dict(data["encoder"])
            encoder["local_layers"] = tuple(encoder.get("local_layers", ()))
            if encoder.get("rope_thetas") is not None:
                encoder["rope_thetas"] = tuple(encoder["rope_thetas"])
            data["encoder"] = EncoderConfig(**encoder)
        else:
            data["encoder"] = None
        return cls(**data)

    @classmethod
    def from_hf(cls, hf_config: Any, architecture: str) -> "ModelConfig":
        """Build from a `transformers.PretrainedConfig` of a supported `architecture` (see
        `registry.py`, which checks that first)."""
        if architecture in ENCODER_ARCHITECTURES:  # model/config/encoder_config.py builds those
            raise ValueError(f"{architecture} is an encoder: model_config_from_hf reads it")
        if architecture in NEMOTRON_H_ARCHITECTURES:  # its own field names, blocks, Mamba-2
            return cls(**nemotron_h_fields(hf_config, architecture))
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError(f"{architecture} with mlp_bias=True is not supported")
        if getattr(hf_config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
        # Gemma 4's refusals first: its configs may give head_dim per layer, unread as a whole.
        gemma4 = (gemma4_fields(hf_config, architecture)
                  if architecture in GEMMA4_ARCHITECTURES else None)
        num_heads = hf_config.num_attention_heads
        if gemma4 is not None:  # per layer (layer_heads), the first layer's as the whole's
            num_kv_heads, head_dim = gemma4["layer_heads"][0]
        else:
            num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
            head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        mla = None
        if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
            if getattr(hf_config, "attention_bias", False):
                raise ValueError(f"{architecture} with attention_bias=True is not supported")
            mla = mla_from_hf(hf_config, architecture == "DeepseekV3ForCausalLM")
            head_dim = mla.qk_rope_head_dim
        is_qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        rope, local_rope = rope_from_hf(hf_config), rope_from_hf(hf_config, "sliding_attention")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        fields = dict(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            # The dense MLPs' width; 0 where there are none (Qwen3.5-MoE's config has no
            # intermediate_size: every layer's MLP is its experts).
            intermediate_size=getattr(hf_config, "intermediate_size", 0),
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope=rope,
            local_rope=None if local_rope == rope else local_rope,
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 2048)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=(is_qwen2 and bool(getattr(hf_config, "qkv_bias", True))) or attention_bias,
            # Qwen2 has q/k/v biases but no output bias; Llama's attention_bias covers o_proj too.
            o_bias=attention_bias and not is_qwen2,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                     *GEMMA3_ARCHITECTURES),
            sliding_windows=_sliding_windows_from_hf(hf_config, architecture),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            mla=mla,
            **experts_from_hf(hf_config, architecture),
            **(gemma3_fields(hf_config, architecture)
               if architecture in GEMMA3_ARCHITECTURES else {}),
        )
        if gemma4 is not None:  # Gemma 4's norms, scales, soft cap
            fields.update(gemma4)
        if architecture in LLAMA4_ARCHITECTURES:  # its own MLP widths, experts, norms
            fields.update(llama4_fields(hf_config, architecture))
        if architecture in HYBRID_ARCHITECTURES:  # linear layers, gated attention, 1 + w norms
            fields.update(hybrid_fields(hf_config, architecture))
        return cls(**fields)


def _sliding_windows_from_hf(hf_config: Any, architecture: str) -> tuple[int | None, ...]:
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM") and window:
        return (window,) * num_layers
    if architecture in _QWEN_ARCHITECTURES and window and getattr(
        hf_config, "use_sliding_window", False
    ):
        first_sliding = getattr(hf_config, "max_window_layers", num_layers)
        return tuple(window if i >= first_sliding else None for i in range(num_layers))
    return (None,) * num_layers


_QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                       "Qwen3MoeForCausalLM")
