"""The weight types a matmul takes in place of a float array, each the value of an nnx Variable
(whole_weight.py): int8 matrices (`Int8Matrix`) and the quantization at load that makes them
(`quantize_model`, int8.py), FP8 matrices (`Fp8Matrix`, `Fp8BlockMatrix`, fp8_weights.py), MXFP4
experts (`Mxfp4Experts`), rows of quantized blocks for the CPU's native GEMM (`QuantizedLinear`,
quantized_rows.py) and panels packed for its float GEMM (`PackedMatrix`, packed.py)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "fp8_block_linear": "fp8_weights", "fp8_matmul": "fp8_weights",
    "fp8_platform_problem": "fp8_weights", "FP8_TYPES": "fp8_weights",
    "Fp8BlockMatrix": "fp8_weights", "Fp8Matrix": "fp8_weights",
    "check_platform": "int8", "check_quantization": "int8", "float_weight": "int8",
    "Fp8Checkpoint": "int8", "Int8Matrix": "int8", "quantize_model": "int8",
    "quantize_placed": "int8", "quantized_parameters": "int8", "QUANTIZED_TYPES": "int8",
    "QUANTIZED_WEIGHTS": "int8", "quantizes": "int8", "refuse_quantized_checkpoint": "int8",
    "Mxfp4Experts": "mxfp4_experts", "mxfp4_mesh_problem": "mxfp4_experts",
    "MXFP4_KEPT": "mxfp4_experts", "partition_specs": "mxfp4_experts",
    "embed": "packed", "output_axes": "packed", "pack_model": "packed",
    "PackedExperts": "packed", "PackedMatrix": "packed",
    "check_quantized_rows": "quantized_rows", "interleaved": "quantized_rows",
    "native_gemm_available": "quantized_rows", "quantized_linear": "quantized_rows",
    "QuantizedLinear": "quantized_rows", "QuantizedRows": "quantized_rows",
    "stack_layers": "quantized_rows",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
