"""Anthropic Messages <-> chat completions: a Messages request becomes the chat request the chat
route runs (its template, tools, grammars, reasoning and tool-call parsers, bounds), and the chat
answer becomes a `message`.

Request, block by block (anything else is a 400 naming where it is):
    system: str | [text blocks], and system messages -> system messages
    user:   text, image (base64 or url source)       -> a user message's parts
            tool_result {tool_use_id, content}       -> a `tool` message each, first
    assistant: text                                  -> content
            tool_use {id, name, input}               -> tool_calls
            thinking {thinking, signature}           -> reasoning_content
    tools [{name, description, input_schema}]        -> function tools
    tool_choice auto | any | tool | none             -> auto | required | the function | none
        (disable_parallel_tool_use: parallel_tool_calls false)
    thinking enabled | adaptive | between_tools | disabled -> chat_template_kwargs.enable_thinking
        (display "omitted": thinking blocks come back without their text)
    output_config.effort, .format (a JSON schema)   -> reasoning_effort, response_format
    stop_sequences -> stop; metadata.user_id -> user; max_tokens, temperature, top_p, top_k as named
    a last assistant message (a prefill)             -> continue_final_message: the answer goes on

Accepted and named in X-Ignored-Fields, since they cannot change what a self-hosted server
generates: `cache_control` (Anthropic's explicit prompt caching: the prefix cache here matches
every prefix by itself), `citations` on text blocks, a tool_use's `caller` and `toolset_name`,
tools' `allowed_callers`, `eager_input_streaming`, `input_examples` and a false
`defer_loading`, a thinking block's `signature` (Anthropic's proof that it wrote the block),
`redacted_thinking` blocks (encrypted: no model here can read them), a tool result's `is_error`
(the chat templates have no place for it; the result's text is the model's to read), thinking's
`budget_tokens` (checked as Anthropic checks it; the model here ends its thinking itself,
within max_tokens).
"""
from __future__ import annotations

import orjson

from xlaserve.http.errors import bad_request, not_supported
from xlaserve.http.messages.protocol import CountTokensRequest, MessagesRequest

_IGNORED_KEYS = ("cache_control", "citations", "signature", "is_error", "caller", "toolset_name")
_BLOCK_KEYS = {
    "text": {"text"}, "image": {"source"}, "tool_result": {"tool_use_id", "content"},
    "tool_use": {"id", "name", "input"}, "thinking": {"thinking"}, "redacted_thinking": {"data"},
}
_BLOCKS_OF = {"user": ("text", "image", "tool_result"),
              "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
_TOOL_KEYS = {"name", "description", "input_schema", "type", "strict"}
# Hints for Anthropic's tool runner and streaming: nothing here reads them.
_IGNORED_TOOL_KEYS = ("cache_control", "allowed_callers", "eager_input_streaming",
                      "input_examples")
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
MIN_THINKING_BUDGET = 1024  # Anthropic's


class Conversion:
    """One request's chat body and the names of what it ignored (module docstring)."""

    def __init__(self, req: CountTokensRequest):
        self.ignored: list[str] = []
        self.messages = self._system(req.system)
        for i, message in enumerate(req.messages):
            where = f"messages[{i}]"
            blocks = ([{"type": "text", "text": message.content}]
                      if isinstance(message.content, str) else message.content)
            if message.role == "user":
                self.messages += self._user(blocks, where)
            elif message.role == "system":
                self.messages += self._system(blocks, where)
            else:
                self.messages.append(self._assistant(blocks, where))
        self.tools = None if req.tools is None else [self._tool(t, i)
                                                     for i, t in enumerate(req.tools)]
        self.tool_choice, self.parallel = self._tool_choice(req.tool_choice)
        self.show_thinking = True  # thinking.display "omitted": blocks without their text
        self.template_kwargs = self._thinking(req)

    def chat_body(self, req: MessagesRequest | CountTokensRequest) -> dict:
        """The chat completion request (the dict ChatCompletionRequest takes)."""
        # A last assistant message is Anthropic's prefill: the answer continues it.
        prefill = self.messages[-1]["role"] == "assistant" and "tool_calls" not in self.messages[-1]
        body = {"model": req.model, "messages": self.messages, "tools": self.tools,
                "tool_choice": self.tool_choice, "parallel_tool_calls": self.parallel,
                "chat_template_kwargs": self.template_kwargs,
                "continue_final_message": prefill or None}
        if req.output_config is not None:
            body["reasoning_effort"] = req.output_config.effort
            if req.output_config.format is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": req.output_config.format.schema_}}
        if isinstance(req, MessagesRequest):
            body.update(max_tokens=max(req.max_tokens, 1), stop=req.stop_sequences,
                        stream=req.stream,
                        temperature=req.temperature, top_p=req.top_p, lora_path=req.lora_path,
                        user=req.metadata.user_id if req.metadata else None)
            if req.top_k is not None:
                body["top_k"] = req.top_k
            if req.stream:
                body["stream_options"] = {"include_usage": True}
        return {k: v for k, v in body.items() if v is not None}

    # --- blocks -------------------------------------------------------------------------------

    def _block(self, block, where: str, kinds: tuple[str, ...]) -> dict:
        """The block checked: a known type for its place, its required keys, no unknown keys
        (ignored ones named)."""
        if not isinstance(block, dict):
            raise bad_request(f"{where} must be an object", "messages")
        kind = block.get("type")
        if kind not in kinds:
            raise bad_request(f"{where}: blocks of type {str(kind)[:64]!r} are not supported here "
                              f"({', '.join(kinds)})", "messages")
        known = _BLOCK_KEYS[kind]
        for key in block:
            if key in _IGNORED_KEYS:
                self.ignored.append(key)
            elif key != "type" and key not in known:
                raise bad_request(f"{where}.{str(key)[:64]}: unknown field of a {kind} block",
                                  "messages")
        missing = [key for key in known if key not in block and key != "content"]
        if missing:
            raise bad_request(f"{where} ({kind}) needs {missing[0]}", "messages")
        return block

    def _system(self, system, where: str = "system") -> list[dict]:
        """`system`, or a system message of `messages` (text blocks)."""
        if system is None:
            return []
        if isinstance(system, str):
            return [{"role": "system", "content": system}]
        parts = [{"type": "text", "text": _text_of(self._block(b, f"{where}[{i}]", ("text",)),
                                                    f"{where}[{i}]")}
                 for i, b in enumerate(system)]
        return [{"role": "system", "content": parts}] if parts else []

    def _user(self, blocks: list, where: str) -> list[dict]:
        """A tool message per tool_result (Anthropic puts them first), then the user's parts."""
        results, parts = [], []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            block = self._block(block, at, _BLOCKS_OF["user"])
            if block["type"] == "text":
                parts.append({"type": "text", "text": _text_of(block, at)})
            elif block["type"] == "image":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
            else:
                results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                                "content": self._result_text(block.get("content", ""), at)})
        return results + ([{"role": "user", "content": parts}] if parts or not results else [])

    def _result_text(self, content, where: str) -> str | list[dict]:
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of text blocks",
                              "messages")
        return [{"type": "text", "text": _text_of(
            self._block(b, f"{where}.content[{k}]", ("text",)), f"{where}.content[{k}]")}
            for k, b in enumerate(content)]

    def _assistant(self, blocks: list, where: str) -> dict:
        texts, calls, thinking = [], [], []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            block = self._block(block, at, _BLOCKS_OF["assistant"])
            kind = block["type"]
            if kind == "text":
                texts.append(_text_of(block, at))
            elif kind == "thinking":
                thinking.append(_string(block, "thinking", at))
            elif kind == "redacted_thinking":
                self.ignored.append("redacted_thinking")
            else:
                if not isinstance(block["input"], dict):
                    raise bad_request(f"{at}.input must be an object", "messages")
                try:
                    arguments = orjson.dumps(block["input"]).decode()
                except orjson.JSONEncodeError:  # nested past orjson's 254 levels
                    raise bad_request(f"{at}.input is nested too deeply", "messages") from None
                calls.append({"id": _string(block, "id", at), "type": "function",
                              "function": {"name": _string(block, "name", at),
                                           "arguments": arguments}})
        message = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        return message

    # --- tools and thinking -------------------------------------------------------------------

    def _tool(self, tool, i: int) -> dict:
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", "tools")
        if tool.get("type", "custom") != "custom":
            # Anthropic's own tools (bash, text editor, web search, ...): their schemas are
            # Anthropic's, and server tools run on Anthropic's side.
            raise not_supported("tools", f"{where}: tools of type {str(tool['type'])[:64]!r} "
                                "(only custom tools, with an input_schema)")
        if tool.get("defer_loading"):  # loaded by Anthropic's tool search, a server tool
            raise not_supported("tools", f"{where}.defer_loading (tool search)")
        for key in tool:
            if key in _IGNORED_TOOL_KEYS or key == "defer_loading":
                self.ignored.append(key)
            elif key not in _TOOL_KEYS:
                raise bad_request(f"{where}.{str(key)[:64]}: unknown field of a tool", "tools")
        if "input_schema" not in tool:
            raise bad_request(f"{where} needs an input_schema", "tools")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if key in tool:
                function[key] = tool[key]
        return {"type": "function", "function": function}

    def _tool_choice(self, choice) -> tuple:
        """(chat's tool_choice, parallel_tool_calls)."""
        if choice is None:
            return None, None
        kind = choice.get("type")
        known = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
        if set(choice) - known or kind not in ("auto", "any", "tool", "none") or \
                not isinstance(choice.get("disable_parallel_tool_use", False), bool):
            raise bad_request("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                              "{\"type\": \"tool\", \"name\": ...}, with "
                              "disable_parallel_tool_use", "tool_choice")
        parallel = False if choice.get("disable_parallel_tool_use") else None
        if kind == "tool":
            return {"type": "function", "function": {"name": choice.get("name")}}, parallel
        return {"any": "required"}.get(kind, kind), parallel

    def _thinking(self, req: CountTokensRequest) -> dict | None:
        """The template's enable_thinking (None: the template's default), and whether the
        thinking text is shown (`display`)."""
        thinking = req.thinking
        if thinking is None:
            return None
        kind, display = thinking.get("type"), thinking.get("display")
        known = {"type"} | ({"display"} if kind in ("enabled", "adaptive") else set()) \
            | ({"budget_tokens"} if kind == "enabled" else set())
        if kind not in ("enabled", "adaptive", "between_tools", "disabled") \
                or set(thinking) - known or display not in (None, "summarized", "omitted"):
            raise bad_request("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                              "{\"type\": \"adaptive\"}, {\"type\": \"between_tools\"} or "
                              "{\"type\": \"disabled\"}, with display \"summarized\" or "
                              "\"omitted\"", "thinking")
        if kind == "disabled":
            return {"enable_thinking": False}
        self.show_thinking = display != "omitted"
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) \
                    or budget < MIN_THINKING_BUDGET:
                raise bad_request(f"thinking.budget_tokens must be an integer >= "
                                  f"{MIN_THINKING_BUDGET}", "thinking")
            if isinstance(req, MessagesRequest) and budget >= req.max_tokens:
                raise bad_request("thinking.budget_tokens must be less than max_tokens",
                                  "thinking")
            self.ignored.append("thinking.budget_tokens")
        return {"enable_thinking": True}


def _text_of(block: dict, where: str) -> str:
    return _string(block, "text", where)


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", "messages")
    return value


def _image_url(block: dict, where: str) -> str:
    """A data: URL for a base64 source, the URL for a url source (http/images.py reads both,
    with its bounds and address checks)."""
    source = block["source"]
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and set(source) == {"type", "media_type", "data"}:
        if source["media_type"] not in _IMAGE_TYPES:
            raise bad_request(f"{where}.source.media_type must be one of "
                              f"{', '.join(_IMAGE_TYPES)}", "messages")
        return f"data:{source['media_type']};base64,{_string(source, 'data', where + '.source')}"
    if kind == "url" and set(source) == {"type", "url"}:
        return _string(source, "url", where + ".source")
    raise bad_request(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} "
                      "or {\"type\": \"url\", \"url\"}", "messages")


# --- the answer --------------------------------------------------------------------------------

def content_blocks(message: dict, show_thinking: bool = True) -> list[dict]:
    """A chat choice's message -> thinking, text and tool_use blocks, in the order written
    (`show_thinking` false: the thinking block without its text, thinking.display "omitted")."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append(thinking_block(message["reasoning_content"] if show_thinking else ""))
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append(tool_use_block(call["id"], call["function"]["name"],
                                     tool_input(call["function"]["arguments"])))
    return blocks


def thinking_block(text: str) -> dict:
    """Reasoning as a thinking block. Its signature is empty: Anthropic's proves Anthropic wrote
    the block, which no other server can."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: dict) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object tool_use.input must be: the tool parsers give JSON text
    of an object (a forced choice's is schema-constrained to one)."""
    value = orjson.loads(arguments)
    if not isinstance(value, dict):
        raise ValueError(f"tool call arguments are not a JSON object: {arguments[:200]!r}")
    return value


def stop_reason(finish_reason: str | None, matched_stop, stop_sequences) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched_stop, str) and matched_stop in (stop_sequences or ()):
        return "stop_sequence", matched_stop
    return "end_turn", None


def usage(chat_usage: dict) -> dict:
    """Chat's usage in Anthropic's terms: input_tokens are the prompt's tokens not read from
    the cache; cache_read_input_tokens those the prefix cache held (Anthropic's sum of the three
    is the prompt). Nothing is written to a cache by request here."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": chat_usage["completion_tokens"]}
