"""The encoders' configs (issue 54): a BERT, XLM-RoBERTa or ModernBERT checkpoint's Hugging Face
config as a ModelConfig with its `encoder` fields (model_config.EncoderConfig), what
model/encoders/encoder.py and model/encoders/modernbert.py do not run refused in one line.
`model_config_from_hf` is the loaders' entry: an encoder's config here, a vision-language model's
(`vision_language_config`), Gemma 3's, Gemma 4's and Llama 4's with images
(`images_config`, by IMAGE_CHECKPOINTS), a decoder's
`ModelConfig.from_hf`."""
from __future__ import annotations

import dataclasses
from typing import Any

from xlaserve.model.config.gemma4_config import GEMMA4_ARCHITECTURES
from xlaserve.model.config.gemma4_vision_config import gemma4_vision_from_hf
from xlaserve.model.config.gemma_config import GEMMA3_ARCHITECTURES, image_checkpoint_text
from xlaserve.model.config.llama4_config import LLAMA4_ARCHITECTURES
from xlaserve.model.config.llama4_vision_config import LLAMA4_IMAGES, llama4_vision_from_hf
from xlaserve.model.config.model_config import ENCODER_ARCHITECTURES, EncoderConfig, ModelConfig
from xlaserve.model.config.rope_config import RopeConfig, partial_rotary_dims
from xlaserve.model.config.siglip_config import siglip_from_hf
from xlaserve.model.config.vision_config import VISION_LANGUAGE_ARCHITECTURES, vision_from_hf

# What the checkpoints' `hidden_act` / `hidden_activation` names mean here.
_GELUS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


# Image checkpoints whose decoder is a text model's beside their tower: the text model's
# architecture and how its tower's config is read (`images_config`).
IMAGE_CHECKPOINTS = {
    "Gemma3ForConditionalGeneration": (GEMMA3_ARCHITECTURES[0], siglip_from_hf),
    LLAMA4_IMAGES: (LLAMA4_ARCHITECTURES[0], llama4_vision_from_hf),
    "Gemma4ForConditionalGeneration": (GEMMA4_ARCHITECTURES[0], gemma4_vision_from_hf),
}
# Each Qwen-VL checkpoint's decoder: its text model's architecture and transformers' default
# mrope_section (vision_language_config).
VISION_LANGUAGE_DECODERS = {
    "Qwen2VLForConditionalGeneration": ("Qwen2ForCausalLM", (16, 24, 24)),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2ForCausalLM", (16, 24, 24)),
    "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", (24, 20, 20)),
    # The hybrid linear-attention text model (linear_attention_config.py), RoPE on a quarter of
    # each full layer's head.
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", (11, 11, 10)),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", (11, 11, 10)),  # its experts
}
# Decoder backbones saved without their LM head (sentence-transformers' saves of a decoder, and
# embedding models that ship so): transformers' classes, read as their causal LM's layers.
BACKBONES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
             "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
# Decoder classifiers and reward models (Skywork-Reward's LlamaForSequenceClassification): the
# causal LM's layers without its LM head; their score head is read apart
# (weights/classifier_head.py).
SEQUENCE_CLASSIFIERS = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                        "MistralForSequenceClassification": "MistralForCausalLM",
                        "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                        "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}


def model_config_from_hf(hf_config: Any, architecture: str,
                         own_code_ok: bool = False) -> ModelConfig:
    """The ModelConfig of a supported `architecture` (registry.py checks that first). A
    backbone (BACKBONES) whose config points AutoModel at the checkpoint's own code (auto_map,
    gte-Qwen2's) is refused unless `own_code_ok` (the operator said how it attends, vLLM's
    --hf-overrides is_causal): that code may attend otherwise than transformers' class."""
    if architecture in ENCODER_ARCHITECTURES:
        return encoder_from_hf(hf_config, architecture)
    if architecture in VISION_LANGUAGE_ARCHITECTURES:
        return vision_language_config(hf_config, architecture)
    if architecture in IMAGE_CHECKPOINTS:
        return images_config(hf_config, architecture)
    if architecture in BACKBONES:
        custom = (getattr(hf_config, "auto_map", None) or {}).get("AutoModel")
        if custom and not own_code_ok:
            raise ValueError(f"{architecture}: the checkpoint's config maps AutoModel to its own "
                             f"code ({custom}), which may attend otherwise than transformers' "
                             f"{architecture}: say how with --hf-overrides '{{\"is_causal\": "
                             "false}' (bidirectional: gte-Qwen2-7B-instruct) or true (causal)")
        return ModelConfig.from_hf(hf_config, BACKBONES[architecture])
    if architecture in SEQUENCE_CLASSIFIERS:
        body = ModelConfig.from_hf(hf_config, SEQUENCE_CLASSIFIERS[architecture])
        return dataclasses.replace(body, lm_head=False)
    return ModelConfig.from_hf(hf_config, architecture)


def vision_language_config(hf_config: Any, architecture: str) -> ModelConfig:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 (dense or MoE): the text config's decoder
    (VISION_LANGUAGE_DECODERS) with multimodal RoPE (its `mrope_section`, else transformers'
    default; interleaved beside a Qwen3-VL-kind tower) and the vision tower's config."""
    text = getattr(hf_config, "text_config", None) or hf_config
    decoder, default_section = VISION_LANGUAGE_DECODERS[architecture]
    config = ModelConfig.from_hf(text, decoder)
    section = config.rope.mrope_section or default_section
    # The sections split the pairs RoPE turns: a quarter of Qwen3.5's (partial_rotary_factor);
    # the rest turn at frequency 0 whatever position they take.
    pairs = partial_rotary_dims(config.head_dim, config.rope.partial_rotary) // 2
    if len(section) != 3 or sum(section) != pairs:
        raise ValueError(f"{architecture}: mrope_section {list(section)} must be three parts of "
                         f"the {pairs} rotated pairs (head_dim x partial_rotary_factor / 2)")
    # Tied or not as the checkpoint says: the top-level flag (the text config's default is not
    # what the checkpoint was saved with).
    tied = bool(getattr(hf_config, "tie_word_embeddings", config.tie_word_embeddings))
    interleaved = VISION_LANGUAGE_ARCHITECTURES[architecture] == "qwen3_vl"  # and Qwen3.5's
    return dataclasses.replace(
        config, architecture=architecture, tie_word_embeddings=tied,
        rope=dataclasses.replace(config.rope, mrope_section=tuple(section),
                                 mrope_interleaved=interleaved),
        vision=vision_from_hf(hf_config, architecture))


def images_config(hf_config: Any, architecture: str) -> ModelConfig:
    """An image checkpoint of IMAGE_CHECKPOINTS: its text config's decoder (tied or not, its
    end-of-turn ids, as the top level says) and its vision tower with the projector or embedder
    (Gemma 3's SigLIP, siglip_config.py; Llama 4's encoder, llama4_vision_config.py; Gemma 4's
    tower, gemma4_vision_config.py, whose audio tower is not read: its inputs are refused)."""
    text_architecture, tower_from_hf = IMAGE_CHECKPOINTS[architecture]
    text, fields = image_checkpoint_text(hf_config, architecture)
    config = dataclasses.replace(ModelConfig.from_hf(text, text_architecture), **fields)
    return dataclasses.replace(config, vision=tower_from_hf(hf_config, architecture,
                                                            config.hidden_size))


def encoder_from_hf(hf_config: Any, architecture: str) -> ModelConfig:
    """A BERT or XLM-RoBERTa encoder's config; what model/encoders/encoder.py does not run is
    refused."""
    if architecture == "ModernBertModel":
        return modernbert_from_hf(hf_config)
    kind = getattr(hf_config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{architecture} with position_embedding_type {kind!r} is not supported "
                         "(absolute only)")
    if getattr(hf_config, "is_decoder", False) or getattr(hf_config, "add_cross_attention", False):
        raise ValueError(f"{architecture} as a decoder (is_decoder, add_cross_attention) is not "
                         "supported: an encoder's attention sees the whole input")
    if hf_config.hidden_act not in _GELUS:
        raise ValueError(f"{architecture} with hidden_act {hf_config.hidden_act!r} is not "
                         f"supported ({', '.join(_GELUS)})")
    offset = 0
    if architecture.startswith("XLMRoberta"):  # create_position_ids_from_input_ids: past padding
        offset = int(hf_config.pad_token_id) + 1
    heads = hf_config.num_attention_heads
    return ModelConfig(
        architecture=architecture, vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
        head_dim=hf_config.hidden_size // heads, rms_norm_eps=float(hf_config.layer_norm_eps),
        rope=RopeConfig(), max_position_embeddings=int(hf_config.max_position_embeddings) - offset,
        lm_head=False, bidirectional=True, qkv_bias=True, o_bias=True,
        encoder=EncoderConfig(type_vocab_size=int(hf_config.type_vocab_size),
                              layer_norm_eps=float(hf_config.layer_norm_eps),
                              position_offset=offset, activation=_GELUS[hf_config.hidden_act]))


def modernbert_from_hf(hf_config: Any) -> ModelConfig:
    """A ModernBERT encoder's config (model/encoders/modernbert.py), from transformers 5's fields
    (layer_types, rope_parameters, sliding_window) or the checkpoint's own (global_attn_every_n_
    layers, global / local_rope_theta, local_attention); biases and other RoPE kinds refused."""
    c = hf_config
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("ModernBertModel with attention_bias or mlp_bias is not supported")
    if c.hidden_activation not in _GELUS:
        raise ValueError(f"ModernBertModel with hidden_activation {c.hidden_activation!r} is not "
                         f"supported ({', '.join(_GELUS)})")
    layers = c.num_hidden_layers
    kinds = getattr(c, "layer_types", None)
    if kinds is None:
        every = c.global_attn_every_n_layers
        kinds = ["full_attention" if i % every == 0 else "sliding_attention" for i in range(layers)]
    if set(kinds) - {"full_attention", "sliding_attention"} or len(kinds) != layers:
        raise ValueError(f"ModernBertModel layer_types {kinds} are not supported")
    rope = getattr(c, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        if any(rope[k].get("rope_type", "default") != "default" for k in rope):
            raise ValueError(f"ModernBertModel rope_parameters {rope} are not supported (default)")
        thetas = (float(rope["full_attention"]["rope_theta"]),
                  float(rope["sliding_attention"]["rope_theta"]))
    else:
        thetas = (float(c.global_rope_theta), float(c.local_rope_theta))
    window = getattr(c, "sliding_window", None) or c.local_attention // 2
    heads = c.num_attention_heads
    return ModelConfig(
        architecture="ModernBertModel", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=layers, num_heads=heads,
        num_kv_heads=heads, head_dim=c.hidden_size // heads, rms_norm_eps=float(c.norm_eps),
        rope=RopeConfig(theta=thetas[0]), max_position_embeddings=int(c.max_position_embeddings),
        lm_head=False, bidirectional=True,
        encoder=EncoderConfig(type_vocab_size=0, layer_norm_eps=float(c.norm_eps),
                              position_offset=0, activation=_GELUS[c.hidden_activation],
                              rope_thetas=thetas,
                              local_layers=tuple(k == "sliding_attention" for k in kinds),
                              local_window=int(window), norm_bias=bool(c.norm_bias)))
