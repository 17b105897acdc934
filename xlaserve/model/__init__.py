"""What a model is: the architectures (one Flax NNX decoder switched by config; `model_class` by
architecture name), their layers and partition specs over the serving mesh, the speculative
draft heads; in folders, the configs (config), the weight types a matmul takes (weight_types:
int8, FP8, MXFP4, packed panels, quantized rows), the encoders (encoders) and vision towers with
their host-side positions (vision)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "config": "config",
    "Eagle3Head": "draft_heads", "NextNHead": "draft_heads",
    "eagle3_capture_layers": "draft_heads", "nextn_config": "draft_heads",
    "encoders": "encoders",
    "grouped_matmul_ragged_dot": "grouped_matmul", "grouped_matmul_tiled": "grouped_matmul",
    "Kernels": "layers",
    "LinearState": "linear_attention", "from_grouped_projections": "linear_attention",
    "by_key_head": "linear_attention", "state_shapes": "linear_attention",
    "VerifiedRows": "linear_attention", "commit_accepted": "linear_attention",
    "Mamba2State": "mamba2", "Mamba2Mixer": "mamba2", "by_group": "mamba2",
    "conv_channels_by_group": "mamba2",
    "KV_CACHE_DTYPES": "fp8_kv_cache", "is_fp8": "fp8_kv_cache",
    "resolve_kv_cache_dtype": "fp8_kv_cache",
    "LoraSpec": "lora", "TARGET_MODULES": "lora", "check_model": "lora",
    "lora_batch": "lora", "module_shapes": "lora", "scaling": "lora", "slot_shapes": "lora",
    "token_request_slots": "lora",
    "POOLING_MODES": "pooling",
    "NORMALIZE_EPS": "pooling",
    "swiglu_xla": "layers", "norm_by_rows": "layers",
    "mla_weights": "mla", "interleaved_rope_rows": "mla",
    "expert_parallel": "moe",
    "architecture_of": "registry", "model_class": "registry", "model_class_check": "registry",
    "check_split": "sharding", "tensor_parallel_size": "sharding", "kv_cache_spec": "sharding", "serving_mesh": "sharding",
    "partition_spec": "sharding",
    "TP": "sharding", "CONV_STATE_SPEC": "sharding", "DELTA_STATE_SPEC": "sharding",
    "abstract_parameters": "transformer", "AttentionMetadata": "transformer",
    "kv_cache_shape": "transformer", "rope_cos_sin": "rope",
    "vision": "vision",
    "weight_types": "weight_types",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
