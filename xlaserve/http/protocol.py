"""Request bodies of the HTTP routes (pydantic), with OpenAI's names plus SGLang's extensions.

The models refuse unknown fields (`extra="forbid"`); request_fields.py parses a body into one, by
default dropping its unknown top-level fields (and stream_options') before validating, logging
them once and naming them in the answer's X-Ignored-Fields header, as OpenAI-compatible peers
accept them; --strict-request-fields keeps the 400. Ranges are checked when the request is turned
into sampling parameters (`serving.sampling_params`), where the messages can name the parameter.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """OpenAI's optional fields take null for "not given" (`"n": null`, `"stream": null`):
        a null field with a default gets its default rather than a 400."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].default is None}

    @property
    def ignored_fields(self) -> list[str]:
        """The unknown fields dropped from the body (request_fields.py), in its order."""
        return self._ignored


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # OpenAI pads stream events with random text against length side channels on its shared
    # service; a self-hosted server adds no padding (documented no-op).
    include_obfuscation: Optional[bool] = None


class SamplingFields(RequestBody):
    """Sampling parameters shared by chat and completions (OpenAI + SGLang extensions)."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # SGLang extensions.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    include_stop_str_in_output: bool = False  # vLLM's name for no_stop_trim
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    rid: Optional[str] = None
    priority: Optional[int] = None  # honoured with --enable-priority-scheduling only
    # SGLang's: a loaded LoRA adapter's name (completions: one per prompt too); a model of
    # BASE:NAME or NAME asks for the same (serving.ServingContext.adapters_of).
    lora_path: Optional[Union[str, list[Optional[str]]]] = None
    # vLLM's structured outputs (constraints.py); the backend name is ignored.
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None  # a 400 when set


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # image_url, input_audio...: refused by name later

    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    # Clients send back assistant messages as they got them (refusal, annotations, audio: null);
    # those fields say nothing about generation, so extra keys of a message are accepted.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # gpt-oss: the Harmony system message's `Reasoning:` line (default medium); other models: a
    # template variable of that name, where their template reads one (else a 400).
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh",
                                       "max"]] = None
    # Accepted for compatibility, documented no-ops: they do not change what is generated here
    # (request_fields.py says why for each).
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None
    prediction: Optional[dict[str, Any]] = None
    # Checked by request_fields.py: only text output; the rest a 400 naming the field when set.
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    moderation: Optional[dict[str, Any]] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    # SGLang extensions.
    chat_template_kwargs: Optional[dict[str, Any]] = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    continue_final_message: bool = False
    # vLLM's: end the prompt opening the assistant's turn (false: the model continues the last
    # message's role), and the tokenizer's special tokens on top of the template's.
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class GenerateRequest(RequestBody):
    """SGLang's native `/generate` body."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    # The last layer's hidden states per token (--enable-return-hidden-states; SGLang's field)
    return_hidden_states: bool = False
    rid: Optional[Union[str, list[str]]] = None
    lora_path: Optional[Union[str, list[Optional[str]]]] = None  # an adapter, or one per prompt
    # A vision model's images (http/images.py): URLs, data: URLs or bare base64; one prompt's
    # (one or a list), or a list per prompt of a batch.
    image_data: Optional[Union[str, list[Optional[Union[str, list[str]]]]]] = None


class LoadLoraRequest(RequestBody):
    """SGLang's and vLLM's load_lora_adapter body (http/lora_routes.py)."""

    lora_name: str = Field(max_length=128)
    lora_path: str = Field(max_length=4096)
    pinned: Optional[bool] = None  # SGLang's: every adapter here stays until unloaded
    load_inplace: Optional[bool] = None  # vLLM's: a name in use is refused either way


class UnloadLoraRequest(RequestBody):
    lora_name: str = Field(max_length=128)
    lora_int_id: Optional[int] = None  # vLLM's: the name decides


class BatchRequest(RequestBody):
    """`POST /v1/batches`."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Optional[dict[str, str]] = None
    output_expires_after: Optional[dict[str, Any]] = None  # refused by name


# --- RL rollouts' control routes (http/rl_routes.py): SGLang's bodies ------------------------------

class WeightUpdateOptions(RequestBody):
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = Field(None, max_length=256)
    torch_empty_cache: Optional[bool] = None  # SGLang's: no PyTorch allocator here


class UpdateWeightsFromDiskRequest(WeightUpdateOptions):
    model_path: str = Field(max_length=4096)
    load_format: Optional[str] = Field(None, max_length=64)
    is_async: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: Optional[bool] = None  # SGLang's: no CUDA graphs here
    token_step: Optional[int] = None  # SGLang's trainer step id: not recorded here
    manifest: Optional[dict[str, Any]] = None  # SGLang's tensor metadata: refused


class UpdateWeightsFromTensorRequest(WeightUpdateOptions):
    # Each entry a base64 safetensors file (SGLang sends pickles, which are refused).
    serialized_named_tensors: list[str] = Field(min_length=1, max_length=64)
    load_format: Optional[str] = Field(None, max_length=64)
    disable_draft_model: Optional[bool] = None


class GetWeightsByNameRequest(RequestBody):
    name: str = Field(max_length=1024)
    truncate_size: int = Field(100, ge=1, le=4096)


class MemoryTagsRequest(RequestBody):
    tags: Optional[list[Literal["weights", "kv_cache"]]] = Field(None, min_length=1, max_length=2)


class PauseGenerationRequest(RequestBody):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(RequestBody):
    torch_empty_cache: Optional[bool] = None


class UpdateWeightVersionRequest(RequestBody):
    new_version: str = Field(max_length=256)
    abort_all_requests: bool = True
