"""The body of `POST /v1/responses`: OpenAI's Responses API fields this server honours.

Unknown fields are refused (a 400 naming the field), as the chat route's are; the fields OpenAI
has and this server does not implement (`include`, `conversation`, `prompt`, built-in tools...)
therefore fail by name instead of being ignored. Item and tool shapes are checked in items.py,
where the messages can say which item is wrong.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FormatConfig(_Strict):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "name", "schema", "strict", "description"}."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, max_length=64)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = Field(default=None, max_length=4096)


class TextConfig(_Strict):
    format: Optional[FormatConfig] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # OpenAI's; refused if set


class ReasoningConfig(_Strict):
    # chat's `reasoning_effort` (the same mapping: chat_template.with_reasoning_effort, Harmony).
    effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None  # refused if set
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None  # deprecated alias


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    store: bool = True
    background: bool = False
    previous_response_id: Optional[str] = Field(default=None, max_length=64)
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = Field(default=None, max_length=512)
    stream: bool = False
    service_tier: Optional[str] = None  # accepted, as chat accepts it: it changes nothing here
    truncation: Optional[Literal["disabled"]] = None  # "auto" (dropping turns) is not implemented
    lora_path: Optional[str] = None  # SGLang's: a loaded LoRA adapter (or model BASE:NAME)
