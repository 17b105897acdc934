"""`stream: true`: a ChatCall's chunks (chat.py `ChatCall.chunks`) as OpenAI's typed Responses
events, each with its `sequence_number`:

    response.created, response.in_progress
    per output item, in the order the model wrote them (reasoning, text, function calls):
        response.output_item.added
        reasoning:  content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
        message:    content_part.added, output_text.delta..., output_text.done, content_part.done
        function:   function_call_arguments.delta..., function_call_arguments.done
        response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it; response.failed
    after an `error` event when generation failed)

The final response is stored (unless `store: false`) before its last event goes out.
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from xlaserve.http.errors import APIError
from xlaserve.http.responses.call import ResponseCall
from xlaserve.http.responses.items import (function_call_item, message_item, new_item_id,
                                           reasoning_item)
from xlaserve.http.responses.store import ResponseStore
from xlaserve.http.serving import sse


class _Events:
    """Numbers the events and keeps the output items: the one open now and those done."""

    def __init__(self):
        self.sequence = 0
        self.output: list[dict] = []  # done items
        self.open: dict | None = None  # the item being written, its text so far in "_text"

    def event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(body)

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def start(self, item: dict) -> list[bytes]:
        self.open = {**item, "_text": ""}
        events = [self.event("response.output_item.added", output_index=len(self.output),
                             item=item)]
        if item["type"] != "function_call":
            events.append(self.event("response.content_part.added", **self._where(),
                                     content_index=0, part=_part(item["type"], "")))
        return events

    def delta(self, kind: str, text: str) -> list[bytes]:
        """Text of an item of `kind`; a new item is started when the open one is of another."""
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.finish("completed")
            item_id = new_item_id("rs" if kind == "reasoning" else "msg")
            maker = reasoning_item if kind == "reasoning" else message_item
            events += self.start(maker(item_id, None, "in_progress"))
        self.open["_text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(f"response.{name}.delta", **self._where(), content_index=0,
                                    delta=text, **extra)]

    def call(self, call_id: str, name: str) -> list[bytes]:
        events = self.finish("completed")
        item = function_call_item(new_item_id("fc"), call_id, name, "", "in_progress")
        return events + self.start(item)

    def arguments(self, text: str) -> list[bytes]:
        self.open["_text"] += text
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=text)]

    def finish(self, status: str) -> list[bytes]:
        """Closes the open item (if any) with its done events."""
        if self.open is None:
            return []
        text = self.open.pop("_text")
        kind, where, events = self.open["type"], self._where(), []
        if kind == "function_call":
            item = {**self.open, "arguments": text, "status": status}
            events.append(self.event("response.function_call_arguments.done", **where,
                                     arguments=text))
        else:
            maker = reasoning_item if kind == "reasoning" else message_item
            item = maker(self.open["id"], text, status)
            name = "reasoning_text" if kind == "reasoning" else "output_text"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self.event(f"response.{name}.done", **where, content_index=0,
                                     text=text, **extra))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=_part(kind, text)))
        events.append(self.event("response.output_item.done", output_index=len(self.output),
                                 item=item))
        self.output.append(item)
        self.open = None
        return events


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": []}


async def events(call: ResponseCall, store: ResponseStore) -> AsyncIterator[bytes]:
    out = _Events()
    yield out.event("response.created", response=call.object("in_progress"))
    yield out.event("response.in_progress", response=call.object("in_progress"))
    finish_reason, error, reasoning = None, None, ""
    async with contextlib.aclosing(call.chat.chunks()) as chunks:  # aborts at once if we stop
        async for chunk in chunks:
            if isinstance(chunk, APIError):
                error = chunk
                break
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    reasoning += delta["reasoning_content"]
                    for event in out.delta("reasoning", delta["reasoning_content"]):
                        yield event
                if delta.get("content"):
                    for event in out.delta("message", delta["content"]):
                        yield event
                for entry in delta.get("tool_calls") or ():
                    if "id" in entry:
                        for event in out.call(entry["id"], entry["function"]["name"]):
                            yield event
                    if entry["function"].get("arguments"):
                        for event in out.arguments(entry["function"]["arguments"]):
                            yield event
                finish_reason = choice.get("finish_reason") or finish_reason
    if error is not None:
        for event in out.finish("incomplete"):
            yield event
        failed = call.object("failed", out.output, error={"code": "server_error",
                                                           "message": error.message})
        await store.save(call, failed)
        yield out.event("error", code="server_error", message=error.message, param=None)
        yield out.event("response.failed", response=failed)
        return
    cut = finish_reason == "length"
    if out.open is None and not out.output:  # nothing was written: an empty message, as JSON has
        for event in out.start(message_item(new_item_id("msg"), None, "in_progress")):
            yield event
    for event in out.finish("incomplete" if cut else "completed"):
        yield event
    usage = call.usage(call.chat.generation.usage(), reasoning)
    final = call.object("incomplete" if cut else "completed", out.output, usage, incomplete=cut)
    await store.save(call, final)
    yield out.event("response.incomplete" if cut else "response.completed", response=final)
