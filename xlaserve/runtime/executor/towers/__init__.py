"""The vision towers of this year's image checkpoints, each run per image apart from the step
(beside vision_encoder.py's Qwen-VL tower): Gemma 3's SigLIP (`SiglipEncoder`), Gemma 4's tower
(`Gemma4Encoder`), Llama 4's encoder over an image's tiles (`Llama4Encoder`)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "SiglipEncoder": "siglip_encoder", "Gemma4Encoder": "gemma4_encoder",
    "Llama4Encoder": "llama4_encoder",
    "siglip_encoder": "siglip_encoder", "gemma4_encoder": "gemma4_encoder",
    "llama4_encoder": "llama4_encoder",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
