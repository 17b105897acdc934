"""What a model is: the architectures (one Flax NNX decoder switched by config; `model_class` by
architecture name), their layers, configs (`ModelConfig`) and partition specs over the serving
mesh, the weight types a matmul takes (int8, FP8, packed panels, quantized rows), the
speculative draft heads, and vision towers with their host-side positions."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "ModelConfig": "config", "model_config_from_hf": "encoder_config",
    "Eagle3Head": "draft_heads", "NextNHead": "draft_heads",
    "eagle3_capture_layers": "draft_heads", "nextn_config": "draft_heads",
    "fp8_platform_problem": "fp8_weights", "FP8_TYPES": "fp8_weights",
    "Fp8BlockMatrix": "fp8_weights", "Fp8Matrix": "fp8_weights",
    "grouped_matmul_ragged_dot": "grouped_matmul", "grouped_matmul_tiled": "grouped_matmul",
    "check_platform": "int8", "check_quantization": "int8", "float_weight": "int8",
    "Fp8Checkpoint": "int8", "quantize_model": "int8", "quantize_placed": "int8",
    "QUANTIZED_TYPES": "int8", "QUANTIZED_WEIGHTS": "int8", "quantizes": "int8",
    "refuse_quantized_checkpoint": "int8",
    "Kernels": "layers",
    "KV_CACHE_DTYPES": "fp8_kv_cache", "is_fp8": "fp8_kv_cache",
    "resolve_kv_cache_dtype": "fp8_kv_cache",
    "LoraSpec": "lora", "TARGET_MODULES": "lora", "check_model": "lora",
    "lora_batch": "lora", "module_shapes": "lora", "scaling": "lora", "slot_shapes": "lora",
    "token_request_slots": "lora",
    "POOLING_MODES": "pooling",
    "NORMALIZE_EPS": "pooling",
    "swiglu_xla": "layers",
    "mla_weights": "mla",
    "Mxfp4Experts": "mxfp4_experts", "mxfp4_mesh_problem": "mxfp4_experts",
    "MXFP4_KEPT": "mxfp4_experts",
    "expert_parallel": "moe",
    "pack_model": "packed",
    "check_quantized_rows": "quantized_rows", "native_gemm_available": "quantized_rows",
    "QuantizedLinear": "quantized_rows", "QuantizedRows": "quantized_rows",
    "stack_layers": "quantized_rows", "interleaved": "quantized_rows",
    "architecture_of": "registry", "model_class": "registry", "model_class_check": "registry",
    "check_expert_parallel": "sharding", "kv_cache_spec": "sharding", "serving_mesh": "sharding",
    "partition_spec": "sharding",
    "TP": "sharding",
    "abstract_parameters": "transformer", "AttentionMetadata": "transformer",
    "kv_cache_shape": "transformer", "rope_cos_sin": "transformer",
    "VisionConfig": "vision_config",
    "encoder_batch": "vision_inputs",
    "mrope_positions": "vision_inputs",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
