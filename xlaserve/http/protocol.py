"""Request bodies of the HTTP routes (pydantic), with OpenAI's names plus SGLang's extensions.

Unknown fields are refused (`extra="forbid"`): a parameter we do not know would otherwise be
silently ignored. Ranges are checked when the request is turned into sampling parameters
(`serving.sampling_params`), where the messages can name the parameter.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xlaserve.http.errors import APIError, validation_message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Strict):
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
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    rid: Optional[str] = None
    priority: Optional[int] = None  # honoured with --enable-priority-scheduling only


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
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    # Accepted for compatibility; they do not change what is generated.
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    # SGLang extensions.
    chat_template_kwargs: Optional[dict[str, Any]] = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    continue_final_message: bool = False


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class GenerateRequest(_Strict):
    """SGLang's native `/generate` body."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    rid: Optional[Union[str, list[str]]] = None


class BatchRequest(_Strict):
    """`POST /v1/batches`."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Optional[dict[str, str]] = None
    output_expires_after: Optional[dict[str, Any]] = None  # refused by name


def parse_body(body: bytes, model: type[BaseModel]):
    """A JSON body as `model`; any problem is a 400 naming the field (FastAPI would answer 422,
    and misread a body sent without a JSON content type)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    return validate_body(data, model)


def validate_body(data: Any, model: type[BaseModel]):
    """Already-parsed JSON (a batch line's `body`) as `model`, with parse_body's 400s."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        message, param = validation_message(error.errors())
        raise APIError(400, message, param=param) from None
