"""Architecture name (`architectures[0]` of a Hugging Face config) -> the module class that runs it."""
from __future__ import annotations

from xlaserve.model.encoders.encoder import Encoder
from xlaserve.model.encoders.modernbert import ModernBert
from xlaserve.model.vision.gemma4_vision import Gemma4VisionLM
from xlaserve.model.vision.qwen_vision import VisionLanguageLM
from xlaserve.model.vision.llama4_vision import Llama4VisionLM
from xlaserve.model.vision.siglip_vision import Gemma3VisionLM
from xlaserve.model.transformer import CausalLM

# The Llama family and its mixture-of-experts kin differ only in config switches, so one class
# serves all of them.
MODEL_CLASSES = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Qwen2MoeForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
    "MixtralForCausalLM": CausalLM,
    "GptOssForCausalLM": CausalLM,
    # Multi-head latent attention (model/mla.py) and DeepSeek's experts (model/routing.py).
    "DeepseekV2ForCausalLM": CausalLM,
    "DeepseekV3ForCausalLM": CausalLM,
    # Gemma 3's text model (model/config/gemma_config.py): local and global layers with their own
    # RoPE, Gemma's norms, GeGLU.
    "Gemma3ForCausalLM": CausalLM,
    # Its image checkpoints: the SigLIP tower and projector beside it (model/vision/siglip_vision.py).
    "Gemma3ForConditionalGeneration": Gemma3VisionLM,
    # Gemma 4's dense text model (model/config/gemma4_config.py): Gemma 3's with plain-weight
    # norms, value norms, layer scalars, soft-capped logits.
    "Gemma4ForCausalLM": CausalLM,
    # Its image checkpoints: its vision tower and embedder beside it (model/vision/gemma4_vision.py;
    # audio refused).
    "Gemma4ForConditionalGeneration": Gemma4VisionLM,
    # Llama 4's text model (model/config/llama4_config.py): interleaved experts with a shared
    # one, NoPE and RoPE layers, the context capped at its attention chunk; its image checkpoints
    # (Scout, Maverick) with their vision encoder beside it (model/vision/llama4_vision.py).
    "Llama4ForCausalLM": CausalLM,
    "Llama4ForConditionalGeneration": Llama4VisionLM,
    # Hybrid linear-attention models (model/config/linear_attention_config.py): Gated DeltaNet
    # layers with a per-request state (model/linear_attention.py) between gated full ones.
    "Qwen3_5ForCausalLM": CausalLM,
    "Qwen3_5MoeForCausalLM": CausalLM,  # with experts in every layer (model/moe.py)
    "Qwen3NextForCausalLM": CausalLM,
    # Nemotron-H (model/config/mamba2_config.py): Mamba-2 layers (model/mamba2.py), NoPE
    # attention, ReLU^2 MLPs, its single-mixer blocks paired into our layers.
    "NemotronHForCausalLM": CausalLM,
    # Vision-language models (model/vision/qwen_vision.py): a Qwen2 decoder with multimodal RoPE and
    # a vision tower the engine runs per image; Qwen3-VL's a Qwen3, Qwen3.5's its hybrid text model.
    "Qwen2VLForConditionalGeneration": VisionLanguageLM,
    "Qwen2_5_VLForConditionalGeneration": VisionLanguageLM,
    "Qwen3VLForConditionalGeneration": VisionLanguageLM,
    "Qwen3_5ForConditionalGeneration": VisionLanguageLM,
    "Qwen3_5MoeForConditionalGeneration": VisionLanguageLM,
    # BERT-family encoders (model/encoders/encoder.py): embedding models, served with
    # --is-embedding.
    "BertModel": Encoder,
    "XLMRobertaModel": Encoder,
    # Cross-encoder rerankers and encoder classifiers: the encoder, its head read apart
    # (weights/classifier_head.py).
    "BertForSequenceClassification": Encoder,
    "XLMRobertaForSequenceClassification": Encoder,
    "ModernBertModel": ModernBert,  # model/encoders/modernbert.py: RoPE, local and global layers
    # Decoder backbones without an LM head (encoder_config.BACKBONES): embedding models.
    "LlamaModel": CausalLM,
    "MistralModel": CausalLM,
    "Qwen2Model": CausalLM,
    "Qwen3Model": CausalLM,
    # Decoder classifiers and reward models (encoder_config.SEQUENCE_CLASSIFIERS): the causal
    # LM's layers, their score head read apart (weights/classifier_head.py).
    "LlamaForSequenceClassification": CausalLM,
    "MistralForSequenceClassification": CausalLM,
    "Qwen2ForSequenceClassification": CausalLM,
    "Qwen3ForSequenceClassification": CausalLM,
}
# For GGUF metadata, which names only a model_type. The MoE families' GGUF files keep their experts
# in merged tensors (ffn_gate_exps, ...) that weights/formats/gguf_file.py does not translate: their
# model_types stay unmapped, so they are refused.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class UnsupportedArchitectureError(ValueError):
    pass


def architecture_of(hf_config) -> str:
    """The architecture name; configs read from GGUF metadata only carry a model_type."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if architectures:
        return architectures[0]
    model_type = getattr(hf_config, "model_type", None)
    return _BY_MODEL_TYPE.get(model_type, f"<model_type {model_type!r}>")


def model_class(architecture: str):
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"Unsupported architecture {architecture!r}. Supported: {', '.join(MODEL_CLASSES)}"
        ) from None


def model_class_check(hf_config) -> str:
    """The architecture name, after checking that we have a module for it."""
    architecture = architecture_of(hf_config)
    model_class(architecture)
    return architecture
