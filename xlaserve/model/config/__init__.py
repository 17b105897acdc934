"""What a checkpoint's Hugging Face config becomes: `ModelConfig` (model_config.py: a decoder's
numbers and switches, with latent attention's and the encoders' own fields), its RoPE
(`RopeConfig`, rope_config.py), a hybrid model's linear layers (`LinearAttentionConfig`,
linear_attention_config.py; Nemotron-H's Mamba-2 ones, `Mamba2Config`, mamba2_config.py), a
vision tower's (`VisionConfig`, vision_config.py; Gemma 3's SigLIP, `SiglipConfig`,
siglip_config.py; Llama 4's encoder, `Llama4VisionConfig`, llama4_vision_config.py; Gemma 4's,
`Gemma4VisionConfig`, gemma4_vision_config.py), the encoders' and vision-language models'
configs (encoder_config.py), whose `model_config_from_hf` is the loaders' entry for every
architecture, and the names Llama 4's checkpoints go by (`LLAMA4_NAMES`, llama4_config.py)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "model_config_from_hf": "encoder_config", "SEQUENCE_CLASSIFIERS": "encoder_config",
    "ModelConfig": "model_config", "replicate_kv_heads": "layer_shapes",
    "text_only": "vision_config",
    "LLAMA4_NAMES": "llama4_config",
    "RopeConfig": "rope_config", "partial_rope_rows": "rope_config",
    "LinearAttentionConfig": "linear_attention_config",
    "HYBRID_ARCHITECTURES": "linear_attention_config",
    "Mamba2Config": "mamba2_config", "NEMOTRON_H_ARCHITECTURES": "mamba2_config",
    "VisionConfig": "vision_config",
    "SiglipConfig": "siglip_config",
    "Llama4VisionConfig": "llama4_vision_config",
    "Gemma4VisionConfig": "gemma4_vision_config",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
