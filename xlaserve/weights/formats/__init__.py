"""The checkpoint formats' readers, each a `TensorSource` (tensor_source.py) that answers Hugging
Face names: GGUF files (`GGUFSource`, gguf_file.py, with their config and tokenizer) and the
quantized formats dequantized as they are read: FP8 (fp8.py), AWQ and GPTQ (awq_gptq.py) and
gpt-oss's MXFP4 experts (mxfp4.py); quantization.py decides which quantized checkpoints load."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "check_fp8_config": "fp8", "check_fp8_tensor": "fp8", "FP8_DTYPE": "fp8", "Fp8Error": "fp8",
    "Fp8Source": "fp8", "SCALE_SUFFIX": "fp8",
    "gguf_file": "gguf_file", "GGUFSource": "gguf_file",
    "first_overflowing_scale": "mxfp4", "GROUP": "mxfp4", "Mxfp4Error": "mxfp4",
    "read_expert_weight": "mxfp4",
    "check_float_tensor": "quantization", "check_quantization_config": "quantization",
    "dequantizing_source": "quantization",
    "TensorSource": "tensor_source",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
