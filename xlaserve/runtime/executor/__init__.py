"""The device side of a step: `ModelRunner` (the KV pool, the compiled step programs, their
inputs), the buckets a step's inputs are padded to (`serving_buckets`) and the padding
(`forward_batch_for`), what a step returns (`StepOutput`), speculative decoding's drafters
(`drafts`: a STANDALONE draft model, an EAGLE3/NEXTN draft head's steps), a vision model's tower
run per image (`VisionEncoder`; this year's families' in `towers`: Gemma 3's SigLIP, Gemma 4's,
Llama 4's) and its images' rows in a step (`PromptImages`, `add_image_rows`)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "Buckets": "forward_batch", "forward_batch_for": "forward_batch",
    "WeightMismatch": "weight_swap",
    "serving_buckets": "buckets", "with_page_size": "buckets",
    "num_pages_for": "kv_pool", "bytes_per_token": "kv_pool",
    "state_bytes_per_slot": "state_pool",
    "HostKvPool": "host_kv_pool", "HostTierCopies": "host_kv_pool",
    "host_tier_pages": "host_kv_pool", "ForwardBatch": "forward_batch",
    "drafts": "drafts",
    "ModelRunner": "model_runner", "StagedStep": "step_inputs",
    "layout_for": "step_inputs", "staged_from_host": "step_inputs", "slots_for": "lora_slots",
    "EmbeddingRunner": "embedding_step",
    "SAMPLING_WIDTHS": "step_inputs", "StepOutput": "step_program",
    "VisionEncoder": "vision_encoder", "towers": "towers",
    "PromptImages": "image_rows",
    "add_image_rows": "image_rows",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
