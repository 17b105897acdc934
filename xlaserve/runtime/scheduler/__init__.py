"""Host bookkeeping, standard library only: which requests run which tokens in the next step
(`Scheduler`), what it keeps per request (`Request`) and hands the executor (`ScheduledBatch`,
`SeqChunk`, `DecodeRows`), the KV pages' allocator and prefix cache (a hybrid model's with its
state snapshots, `StatePrefixReuse`), and speculative decoding's
drafts and acceptance (`Speculator`, `SpeculativeConfig`, `DraftTree`)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "NULL_PAGE": "page_allocator", "PageAllocator": "page_allocator",
    "pages_for_tokens": "page_allocator", "HostTier": "host_tier", "LOAD": "host_tier",
    "SAVE": "host_tier",
    "DecodeRows": "request", "Request": "request", "Pooled": "request", "AdapterRef": "request",
    "RequestTooLong": "request",
    "SampledRow": "request", "ScheduledBatch": "request", "SeqChunk": "request",
    "prefill_budget": "scheduler", "Scheduler": "scheduler", "NoSpeculation": "scheduler",
    "EveryRequest": "scheduler", "PrefixReuse": "prefix_reuse",
    "StatePrefixReuse": "state_reuse", "STATE_COPIES": "state_reuse",
    "process_pooled": "pooled", "retract_running": "retraction",
    "DraftTree": "speculation", "row_depths": "speculation", "SpeculativeConfig": "speculation",
    "Speculator": "speculation",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
