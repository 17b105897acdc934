"""One `POST /v1/responses`: the request as a chat completion request (items.py), run by the
chat route's own ChatCall (templates, tools, grammars, reasoning parsers, bounds), and its answer
as a Responses object.

    ResponsesRequest (+ the stored conversation of previous_response_id)
      -> ChatCompletionRequest -> ChatCall -> chat.completion dict -> `response` object
"""
from __future__ import annotations

import functools
import time

import orjson

from xlaserve.http.chat import ChatCall
from xlaserve.http.errors import APIError, bad_request, not_supported, renamed_errors
from xlaserve.http.protocol import ChatCompletionRequest
from xlaserve.http.request_fields import validate_body
from xlaserve.http.responses.items import chat_messages, input_items, new_item_id, output_items
from xlaserve.http.responses.protocol import ResponsesRequest
from xlaserve.http.serving import ServingContext

# The chat request's names of what a 400 blames -> the Responses request's.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512  # OpenAI's limits


class ResponseCall:
    """The checked request, its conversation (input items), and its ChatCall once created."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, previous: dict | None):
        """`previous`: the stored record of previous_response_id, whose conversation (input and
        output items) comes before this request's input."""
        self.ctx, self.req = ctx, req
        self.id = new_item_id("resp")
        self.created_at = int(time.time())
        _check_unsupported(req)
        history = [*previous["_input"], *previous["output"]] if previous is not None else []
        self.input = history + input_items(req.input, len(history))  # what input_items lists
        if history:
            _check_conversation_size(ctx, self.input)
        with renamed_errors(_renamed):
            self.chat_request = validate_body(_chat_body(req, self.input), ChatCompletionRequest)
        self.chat: ChatCall | None = None

    async def create(self) -> None:
        """Templates, checks, compiles the grammar and submits (ChatCall.create), its 400s in
        this API's names."""
        continued = self.req.previous_response_id is not None
        with renamed_errors(functools.partial(_renamed, continued=continued)):
            self.chat = await ChatCall.create(self.ctx, self.chat_request)

    def object(self, status: str, output: list[dict] | None = None, usage: dict | None = None,
               incomplete: bool = False, error: dict | None = None) -> dict:
        """The `response` object in `status`, the request's settings echoed as OpenAI does."""
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": req.background, "error": error,
            "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.ctx.served_model_name, "output": output or [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": _format_echo(req)},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }

    def finished(self, chat_body: dict) -> dict:
        """The chat.completion of this call -> the completed (or incomplete) response."""
        choice = chat_body["choices"][0]
        cut = choice["finish_reason"] == "length"
        output = output_items(choice["message"], finished=not cut)
        return self.object("incomplete" if cut else "completed", output,
                           self.usage(chat_body["usage"], choice["message"].get("reasoning_content")),
                           incomplete=cut)

    def usage(self, chat_usage: dict, reasoning: str | None) -> dict:
        """Chat's usage in this API's names. Reasoning tokens: the reasoning text re-tokenized
        (the engine counts tokens, not which part of the output they fell in). No cache writes:
        those are OpenAI's explicit prompt caching; the prefix cache here is implicit."""
        reasoning_tokens = len(self.ctx.tokenizer.encode(reasoning, add_special_tokens=False)) \
            if reasoning else 0
        cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": chat_usage["total_tokens"]}


def _check_unsupported(req: ResponsesRequest) -> None:
    if req.text is not None and req.text.verbosity is not None:
        raise not_supported("text.verbosity")
    if req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
        raise not_supported("reasoning.summary", "reasoning summaries")
    if req.background and not req.store:
        raise bad_request("background responses must be stored: store cannot be false", "store")
    if req.background and req.stream:
        raise not_supported("stream", "stream with background")
    metadata = req.metadata or {}
    if len(metadata) > _METADATA_PAIRS or any(
            len(k) > _METADATA_KEY or len(v) > _METADATA_VALUE for k, v in metadata.items()):
        raise bad_request(f"metadata takes at most {_METADATA_PAIRS} pairs, keys up to "
                          f"{_METADATA_KEY} characters and values up to {_METADATA_VALUE}",
                          "metadata")


def _check_conversation_size(ctx: ServingContext, items: list[dict]) -> None:
    """A conversation continued by previous_response_id is bounded as if sent whole: its items
    (all of them are stored again with this response) at most --max-payload-size bytes. Without
    it, reasoning items (which many templates leave out of the prompt) could grow a chain's
    records without end."""
    limit = ctx.engine.server_args.max_payload_size
    if limit and len(orjson.dumps(items)) > limit:
        raise bad_request(f"the conversation continued by previous_response_id is over "
                          f"--max-payload-size ({limit} bytes): start a new one",
                          "previous_response_id")


def _chat_body(req: ResponsesRequest, items: list[dict]) -> dict:
    messages = chat_messages(items)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body = {"model": req.model, "messages": messages,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "tools": _chat_tools(req.tools),
            "tool_choice": _chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req),
            "reasoning_effort": req.reasoning.effort if req.reasoning else None,
            "stream": req.stream, "user": req.user, "lora_path": req.lora_path}
    return {k: v for k, v in body.items() if v is not None}


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools {"type": "function", "name", ...} -> chat's {"type", "function": {...}}."""
    if tools is None:
        return None
    chat_tools = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools[{i}]: tools of type {str(kind)[:64]!r} are not supported; "
                              "only 'function' tools", "tools")
        unknown = set(tool) - _TOOL_KEYS
        if unknown:
            raise bad_request(f"tools[{i}]: unknown or unsupported fields {sorted(unknown)[:8]}",
                              "tools")
        chat_tools.append({"type": "function",
                           "function": {k: v for k, v in tool.items() if k != "type"}})
    return chat_tools


def _chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice  # none / auto / required (anything else: chat's 400 names tool_choice)
    if choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                      '{"type": "function", "name": ...}', "tool_choice")


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise bad_request("text.format of type 'json_schema' needs a name and a schema",
                          "text.format")
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
            "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def _format_echo(req: ResponsesRequest) -> dict:
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


def _renamed(error: APIError, continued: bool = False) -> APIError:
    """`error` in this API's names. A prompt over the context (`context_length_exceeded`, param
    `input` as OpenAI's) continuing a conversation says so: its new input alone may be short."""
    error.param = _PARAMS.get(error.param, error.param)
    if error.code == "context_length_exceeded":
        error.message = error.message.replace("max_tokens", "max_output_tokens")
        if continued:
            error.message += (" The input includes the conversation continued by "
                              "previous_response_id: start a new conversation, or send a "
                              "shortened one as input.")
    return error
