"""`stream: true`: a ChatCall's chunks (chat.py `ChatCall.chunks`) as Anthropic's events, each
an SSE `event:` line with its type and a `data:` line:

    message_start (the message with no content, its input tokens), ping
    per content block, in the order the model wrote them (thinking, text, tool_use):
        content_block_start, content_block_delta... (thinking_delta, text_delta,
        input_json_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

A generation that fails mid-stream ends with an `error` event in Anthropic's error shape.
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

import orjson

from xlaserve.http.errors import APIError
from xlaserve.http.messages import convert
from xlaserve.http.messages.call import MessageCall

_DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
           "tool_use": ("input_json_delta", "partial_json")}


def event(kind: str, **fields) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + \
        b"\n\n"


class _Blocks:
    """The content blocks written so far; `open` is the one being written."""

    def __init__(self):
        self.count = 0
        self.open: str | None = None  # its type

    def start(self, block: dict) -> list[bytes]:
        events = self.stop()
        self.open = block["type"]
        return events + [event("content_block_start", index=self.count, content_block=block)]

    def delta(self, kind: str, text: str | None) -> list[bytes]:
        """Text of a block of `kind` (a new block when the open one is of another); None: the
        block without its text (thinking.display "omitted")."""
        events = []
        if self.open != kind:
            empty = {"thinking": convert.thinking_block(""),
                     "text": {"type": "text", "text": ""}}[kind]
            events = self.start(empty)
        if text is None:
            return events
        name, key = _DELTAS[kind]
        return events + [event("content_block_delta", index=self.count,
                               delta={"type": name, key: text})]

    def arguments(self, text: str) -> list[bytes]:
        name, key = _DELTAS["tool_use"]
        return [event("content_block_delta", index=self.count, delta={"type": name, key: text})]

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [event("content_block_stop", index=self.count - 1)]


async def events(call: MessageCall) -> AsyncIterator[bytes]:
    prompt_tokens = len(call.chat.prompt_ids)
    yield event("message_start", message=call.message(
        [], (None, None), {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": 0, "output_tokens": 0}))
    yield event("ping")
    blocks = _Blocks()
    finish_reason = matched_stop = usage = error = None
    async with contextlib.aclosing(call.chat.chunks()) as chunks:  # aborts at once if we stop
        async for chunk in chunks:
            if isinstance(chunk, APIError):
                error = chunk
                break
            usage = chunk.get("usage") or usage
            for choice in [] if call.prefill_only else chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    shown = delta["reasoning_content"] if call.show_thinking else None
                    for item in blocks.delta("thinking", shown):
                        yield item
                if delta.get("content"):
                    for item in blocks.delta("text", delta["content"]):
                        yield item
                for entry in delta.get("tool_calls") or ():
                    if "id" in entry:
                        block = convert.tool_use_block(entry["id"], entry["function"]["name"], {})
                        for item in blocks.start(block):
                            yield item
                    if entry["function"].get("arguments"):
                        for item in blocks.arguments(entry["function"]["arguments"]):
                            yield item
                if choice.get("finish_reason"):
                    finish_reason, matched_stop = choice["finish_reason"], choice.get("matched_stop")
    for item in blocks.stop():
        yield item
    if error is not None:
        yield event("error", error=anthropic_error(error))
        return
    stop_reason, stop_sequence = call.stop_reason(finish_reason, matched_stop)
    yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage=call.usage(usage or call.chat.generation.usage()))
    yield event("message_stop")


def anthropic_error(error: APIError) -> dict:
    return error.anthropic_body()["error"]
