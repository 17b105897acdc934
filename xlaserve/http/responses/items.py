"""Responses API items <-> chat messages.

Input: a string (one user message) or a list of items, each one of
    {"type": "message", "role": user|system|developer|assistant, "content": str | [parts]}
        (parts `input_text` / `output_text`; `type` may be left out, as OpenAI allows)
    {"type": "function_call", "call_id", "name", "arguments"}      -> an assistant's tool_calls
    {"type": "function_call_output", "call_id", "output"}          -> a `tool` message
    {"type": "reasoning", "content": [{"type": "reasoning_text", "text"}]}
                                                  -> the next assistant message's reasoning_content
so an earlier response's `output` can be sent back as input as it came. Anything else is a 400
naming `input` and the item. Output: a chat choice's message -> reasoning, message and
function_call items.
"""
from __future__ import annotations

import uuid

from xlaserve.http.errors import bad_request

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(value: str | list[dict]) -> list[dict]:
    """`input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


def chat_messages(items: list[dict]) -> list[dict]:
    """Items -> chat messages (the dicts ChatCompletionRequest takes). Consecutive function calls
    become one assistant message's tool_calls, joined to the assistant text just before them."""
    messages: list[dict] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, where)
            continue
        if kind == "message":
            message = {"role": _role(item, where), "content": _text(item.get("content"), where)}
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "_open" in last:
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": _string(item, "call_id", where),
                       "content": _text(item.get("output"), where + ".output")}
        else:
            raise bad_request(f"{where}: items of type {str(kind)[:64]!r} are not supported "
                              "(message, function_call, function_call_output, reasoning)", "input")
        if message["role"] == "assistant":
            message["_open"] = True  # function calls that follow join it
            if reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
    if reasoning is not None:  # reasoning with no answer after it
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    for message in messages:
        message.pop("_open", None)
    return messages


def _role(item: dict, where: str) -> str:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", "input")
    return role


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", "input")
    return value


def _text(content, where: str) -> str:
    """A string, or the texts of `input_text` / `output_text` parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]: only input_text and output_text parts with a "
                              f"text are supported, got {str(kind)[:64]!r}", "input")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    parts = item.get("content") or []
    if not isinstance(parts, list) or any(
            not isinstance(p, dict) or p.get("type") != "reasoning_text"
            or not isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"{where}.content must be a list of reasoning_text parts", "input")
    return "".join(p["text"] for p in parts)


def output_items(message: dict, finished: bool) -> list[dict]:
    """A chat choice's message -> Responses output items: its reasoning, its text (when there is
    text, or nothing else), its tool calls. `finished`: False when max_output_tokens cut it."""
    status = "completed" if finished else "incomplete"
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_item_id("rs"), message["reasoning_content"], status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_item_id("msg"), message.get("content") or "", status))
    for call in calls:
        items.append(function_call_item(new_item_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], status))
    return items


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def listed_item(item: dict, index: int) -> dict:
    """An input item as `input_items` lists it: with an id (its index where the client gave
    none), a status, and a message's string content as one text part."""
    item = {"type": "message", **item}
    item.setdefault("id", f"item_{index}")
    item.setdefault("status", "completed")
    if item["type"] == "message" and isinstance(item.get("content"), str):
        part = {"type": "input_text", "text": item["content"]} if item.get("role") != "assistant" \
            else {"type": "output_text", "text": item["content"], "annotations": []}
        item["content"] = [part]
    return item
