"""Responses API items <-> chat messages.

Input: a string (one user message) or a list of items, each one of (made canonical: an id each,
content as parts, only these fields)
    {"type": "message", "role": user|system|developer|assistant, "content": str | [parts]}
        (parts `input_text` / `output_text`, and a user's `input_image` {"image_url": a data:
        or http(s) URL, "detail"} for a vision model; `type` may be left out, as OpenAI allows)
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


def input_items(value: str | list, start: int = 0) -> list[dict]:
    """`input` (a string is one user message) as canonical items: checked, with an id each and
    only the fields used, so what is stored for previous_response_id is what the prompt holds.
    `start`: the index of the first item of a conversation whose earlier items are stored."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    return [_canonical(item, f"input[{i}]") for i, item in enumerate(value, start)]


def _canonical(item, where: str) -> dict:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", "input")
        content = item.get("content")
        if role == "user" and isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "input_image" for p in content):
            parts = _parts_with_images(content, where)
        else:
            part = "output_text" if role == "assistant" else "input_text"
            parts = [{"type": part, "text": _text(content, where)}]
            if role == "assistant":
                parts[0]["annotations"] = []
        return {"type": "message", "id": _id(item, "msg"), "role": role, "status": "completed",
                "content": parts}
    if kind == "function_call":
        return {"type": "function_call", "id": _id(item, "fc"),
                "call_id": _string(item, "call_id", where), "name": _string(item, "name", where),
                "arguments": _string(item, "arguments", where), "status": "completed"}
    if kind == "function_call_output":
        return {"type": "function_call_output", "id": _id(item, "fco"),
                "call_id": _string(item, "call_id", where),
                "output": _text(item.get("output"), where + ".output"), "status": "completed"}
    if kind == "reasoning":
        return reasoning_item(_id(item, "rs"), _reasoning_text(item, where), "completed")
    raise bad_request(f"{where}: items of type {str(kind)[:64]!r} are not supported "
                      "(message, function_call, function_call_output, reasoning)", "input")


def _id(item: dict, prefix: str) -> str:
    """The client's id when it looks like one, else a new one."""
    given = item.get("id")
    return given if isinstance(given, str) and 0 < len(given) <= 64 else new_item_id(prefix)


def chat_messages(items: list[dict]) -> list[dict]:
    """Canonical items -> chat messages (the dicts ChatCompletionRequest takes). Consecutive
    function calls become one assistant message's tool_calls, joined to the assistant text just
    before them; reasoning goes to the next assistant message's reasoning_content."""
    messages: list[dict] = []
    reasoning: str | None = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = (reasoning or "") + "".join(p["text"] for p in item["content"])
            continue
        if kind == "message":
            message = {"role": item["role"], "content": _chat_content(item["content"])}
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "_open" in last:
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:  # function_call_output
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
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


def _parts_with_images(content: list, where: str) -> list[dict]:
    """A user message's input_text and input_image parts, checked, in order."""
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_text" and isinstance(part.get("text"), str):
            parts.append({"type": "input_text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "input_image", "image_url": part["image_url"],
                          "detail": part.get("detail") or "auto"})
        else:
            raise bad_request(f"{where}.content[{j}]: a user's parts are input_text with a text "
                              f"and input_image with an image_url (a data: or http(s) URL; "
                              f"file_id is not supported), got {str(kind)[:64]!r}", "input")
    return parts


def _chat_content(parts: list[dict]):
    """A canonical message's content as a chat message's: its text, or (with images) the chat
    API's text and image_url parts."""
    if all(p["type"] != "input_image" for p in parts):
        return parts[0]["text"]
    return [{"type": "text", "text": p["text"]} if p["type"] == "input_text" else
            {"type": "image_url", "image_url": {"url": p["image_url"], "detail": p["detail"]}}
            for p in parts]


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

