"""What a token is drawn from: SGLang-named `SamplingParams` and the one check of a request
(`check_request`, `RequestLimits`), on-device sampling (`sample`), which optional parts a step
runs (`StepNeeds`), prompt logprobs, and structured outputs' grammars (`GrammarBackend`)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "check_depth": "grammar", "CONSTRAINT_DEAD_END": "grammar", "GrammarBackend": "grammar",
    "check_request": "params", "CONSTRAINT_FIELDS": "params", "constraint_of": "params",
    "has_constraint": "params",
    "InvalidGrammar": "params", "InvalidSamplingParam": "params", "MAX_LOGIT_BIAS": "params",
    "MAX_SUPPRESSED_IDS": "params", "MAX_TOP_LOGPROBS": "params", "prompt_token_ids": "params",
    "RequestLimits": "params", "RowSamplingParams": "params", "SamplingParams": "params",
    "stop_token_set": "params", "token_id": "params",
    "NO_TARGET": "prompt_logprobs", "prompt_logprobs": "prompt_logprobs",
    "PromptLogprobCollector": "prompt_logprobs", "PromptLogprobs": "prompt_logprobs",
    "add_sampled": "sampler", "build_sampling_metadata": "params", "sample": "sampler",
    "SampleOutput": "sampler", "SamplingMetadata": "params",
    "ACCELERATOR_VARIANTS": "step_needs", "EVERYTHING": "step_needs", "needs_of": "step_needs",
    "part": "step_needs", "program_needs": "step_needs", "RUN_TIME": "step_needs",
    "StepNeeds": "step_needs", "VARIANT_NAMES": "step_needs",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
