"""Anthropic's Messages API request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`).

Top-level fields are checked here; the content blocks, tools, tool choice and thinking settings
are checked by convert.py, whose 400s name the block they blame. Unknown top-level fields follow
the server's policy (request_fields.py: dropped and named in X-Ignored-Fields, or refused with
--strict-request-fields), as on every other route: among them Anthropic's that cannot change
what a self-hosted server generates (`cache_control`, the prefix cache being automatic;
`container`, `diagnostics`, `inference_geo`, `speed`, `user_profile_id`, `workspace_id`).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from xlaserve.http.protocol import RequestBody


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system"]
    content: Union[str, list[dict[str, Any]]]


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[OutputFormat] = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: Optional[str] = Field(None, max_length=256)  # Anthropic's limit


class CountTokensRequest(RequestBody):
    """The fields that make the prompt: what count_tokens takes."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[OutputConfig] = None


class MessagesRequest(CountTokensRequest):
    # 0: the prompt is prefilled (into the prefix cache) and nothing generated, as Anthropic's
    # "pre-warming the cache".
    max_tokens: int = Field(ge=0)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    # Sampling: in the API before its newest models (which dropped them) and still sent by
    # older clients; Anthropic's ranges, temperature and top_p in [0, 1] (a 400 above).
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=1)
    metadata: Optional[Metadata] = None
    # Anthropic's capacity tier: one tier here, a documented no-op (docs/server.md).
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    # SGLang's extension on every generation route: a loaded LoRA adapter by name.
    lora_path: Optional[str] = None
