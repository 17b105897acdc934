"""A checkpoint's quantized weights kept as stored, for the kernels that multiply them, instead of
dequantized at load: FP8 projections on GPUs with FP8 tensor cores (fp8_kept.py), gpt-oss's MXFP4
experts with `--quantization mxfp4` (mxfp4_kept.py), and a GGUF's blocks for the CPU's native
quantized GEMM (gguf_kept.py)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "convert_kept": "fp8_kept", "kept_quantization": "fp8_kept",
    "gguf_kept": "gguf_kept",
    "mxfp4_kept": "mxfp4_kept",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
