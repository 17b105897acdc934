"""The engine: one loop thread per replica. `EngineCore` takes requests in any thread and streams
each one's `OutputDelta`s; `make_engine_core` builds it, or --dp-size replicas behind one facade;
`AsyncRequestGroup` reads a call's requests back from asyncio; `read_image` an offline caller's
image for a vision model."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "AsyncRequestGroup": "async_requests", "Choice": "async_requests",
    "EngineDeadError": "async_requests", "LIVENESS_POLL_S": "async_requests",
    "StreamBuffer": "async_requests",
    "sglang_output": "async_requests",
    "EngineCore": "core", "QueueFull": "core", "EMBEDS": "pooled_outputs",
    "GENERATES": "pooled_outputs", "WrongKindOfServer": "pooled_outputs",
    "make_engine_core": "data_parallel",
    "UnknownAdapter": "lora_adapters", "NO_ADAPTERS": "lora_adapters",
    "WeightUpdateError": "weight_updates",
    "OutputDelta": "messages",
    "read_image": "image_prompts", "images_per_prompt": "image_prompts",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
