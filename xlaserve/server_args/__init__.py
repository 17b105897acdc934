"""Every command-line flag: `ServerArgs`, one flat dataclass composed of one dataclass per area
(args.py lists them), each area's module holding its flags with their help and the checks of its
own values; `conflicts.py`, the one table of flags that do not combine; `platform_defaults`, the
flags whose default depends on the hardware."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "ServerArgs": "args",
    "Mode": "conflicts", "refuse_conflicts": "conflicts",
    "public_name": "flag",
    "configure_logging": "logs",
    "hf_overrides": "model_flags", "reranker_tokens": "model_flags",
    "pooler_config": "output_flags",
    "DEFAULT_MAX_RANK": "lora_flags", "TARGET_MODULES": "lora_flags",
    "check_adapter_name": "lora_flags", "lora_paths_of": "lora_flags",
    "target_modules_of": "lora_flags",
    "images_per_request": "image_flags", "processor_kwargs": "image_flags",
    "platform_defaults": "platform_defaults", "device_memory": "platform_defaults",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
