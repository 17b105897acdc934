"""A vision-language model's images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the vision tower and the
decoder beside it (`VisionLanguageLM`, qwen_vision.py), and on the host the tower's inputs laid
out (`encoder_batch`) and a prompt's multimodal RoPE positions (`mrope_positions`,
vision_inputs.py). The tower's config is config/vision_config.py. Gemma 3's SigLIP tower and
projector and the decoder beside them (`Gemma3VisionLM`, siglip_vision.py; its config
config/siglip_config.py). Llama 4's vision encoder and projector and the decoder beside them
(`Llama4VisionLM`, llama4_vision.py; its config config/llama4_vision_config.py), and its image
processor (`TileProcessor`, llama4_tiles.py). Gemma 4's tower and embedder and the decoder beside
them (`Gemma4VisionLM`, gemma4_vision.py; its config config/gemma4_vision_config.py)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "VisionLanguageLM": "qwen_vision", "Gemma3VisionLM": "siglip_vision",
    "Llama4VisionLM": "llama4_vision", "TileProcessor": "llama4_tiles",
    "Gemma4VisionLM": "gemma4_vision",
    "encoder_batch": "vision_inputs", "mrope_positions": "vision_inputs",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
