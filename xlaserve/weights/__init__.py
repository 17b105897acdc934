"""Reading checkpoints into a sharded model: `load_model` reads safetensors, GGUF, Orbax and the
quantized formats (formats: each a TensorSource), through the conversion cache or as dummy
weights, keeping some quantized weights as stored (kept_quantized); `put` places host arrays on
the devices of several processes; `load_draft_head` a speculative draft head's weights."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "MODULES_FILE": "pooling", "Pooling": "pooling", "PoolingConfigError": "pooling",
    "read_pooling": "pooling",
    "CROSS_ENCODERS": "classifier_head", "ClassifierHead": "classifier_head",
    "ClassifierHeadError": "classifier_head", "checkpoint_head": "classifier_head",
    "token_logit_head": "classifier_head",
    "check_replica_devices": "loader", "load_model": "loader", "LoadedModel": "loader",
    "read_config": "loader", "resolve_dtype": "loader", "server_load_options": "loader",
    "tensor_parallel_mesh": "loader", "resolve_model_path": "loader",
    "draft_head_builder": "draft_head", "hf_config_of": "draft_head",
    "load_draft_head": "draft_head",
    "load_server_draft_head": "draft_head",
    "formats": "formats",
    "kept_quantized": "kept_quantized",
    "put": "placement",
    "LoraAdapter": "lora_adapter", "LoraAdapterError": "lora_adapter",
    "load_adapter": "lora_adapter",
    "model_from_state": "in_memory", "model_from_tensors": "in_memory",
    "safetensors_tensors": "in_memory", "WeightError": "param_layout",
    "TensorBuckets": "in_memory",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
