"""Gemma 4's tool calls (`--tool-call-parser gemma4`, SGLang's and vLLM's name).

Gemma 4's chat template writes each call as one block of special tokens:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

and several calls one after the other, nothing between them. The arguments are not JSON: keys
are bare (the template's `format_argument(value, escape_keys=False)`), strings are delimited by
the `<|"|>` token (no escapes inside), booleans are `true` / `false`, numbers bare, objects
`{k:v,...}` and arrays `[v,...]` (nested ones alike). As SGLang's and vLLM's parsers do, a key
written `<|"|>k<|"|>` is read as `k`, a bare `null` or `None` (what older templates render for
Python's None) as null, and any other bare value that is not a JSON number as a string.

A block that is not `call:NAME{...}` with balanced braces and delimited strings, or has anything
but whitespace after its closing brace, stays in the content verbatim (tool_regions.py). The
template follows the calls with `<|tool_response>`, where the tool's answer goes: a stop token
of the model's, dropped from the content if it shows.
"""
from __future__ import annotations

import re

from xlaserve.http.parsing.tool_regions import EndMarkerParser, ToolCall, dumps, loads, skip_ws

STRING = '<|"|>'  # one token: opens and closes a string
_CALL = re.compile(r"\s*call:([\w.\-]+)\{")
_BARE_KEY = re.compile(r"[^:{}\[\],]+")
_BARE_VALUE = re.compile(r"[^,}\]]*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


class Gemma4Parser(EndMarkerParser):
    starts, end = ("<|tool_call>",), "<tool_call|>"
    drops = ("<|tool_response>",)

    def _body(self, body, final):
        m = _CALL.match(body)
        if m is None:
            return None
        try:
            arguments, end = _object(body, m.end())
            if body[end:].strip():
                return None
            return [ToolCall(m[1], dumps(arguments))]
        except (ValueError, RecursionError):  # (dumps: a number past a float's range)
            return None


def _object(s: str, i: int) -> tuple[dict, int]:
    """The object whose `{` ends at s[i - 1]: (its value, the index past its `}`)."""
    members, i = _items(s, i, "}", _member)
    return dict(members), i


def _items(s: str, i: int, close: str, item) -> tuple[list, int]:
    """The `,`-separated items (each read by `item`) of an object or array from s[i] to its
    `close`: (the items, the index past `close`)."""
    out = []
    while True:
        i = skip_ws(s, i)
        if s.startswith(close, i):
            return out, i + 1
        value, i = item(s, i)
        out.append(value)
        i = skip_ws(s, i)
        if s.startswith(",", i):
            i += 1
        elif not s.startswith(close, i):
            raise ValueError(f"expected , or {close}")


def _member(s: str, i: int) -> tuple[tuple[str, object], int]:
    key, i = _key(s, i)
    value, i = _value(s, i)
    return (key, value), i


def _string(s: str, i: int) -> tuple[str, int]:
    """The string whose opening `<|"|>` is at s[i]."""
    start = i + len(STRING)
    end = s.find(STRING, start)
    if end == -1:
        raise ValueError("unterminated string")
    return s[start:end], end + len(STRING)


def _key(s: str, i: int) -> tuple[str, int]:
    """A key and its `:` -> (the key, the index past the `:`)."""
    if s.startswith(STRING, i):
        key, i = _string(s, i)
    else:
        m = _BARE_KEY.match(s, i)
        key = m[0].strip() if m else ""
        if not key or STRING in key:
            raise ValueError("expected a key")
        i = m.end()
    i = skip_ws(s, i)
    if not s.startswith(":", i):
        raise ValueError("expected :")
    return key, i + 1


def _value(s: str, i: int):
    i = skip_ws(s, i)
    if s.startswith(STRING, i):
        return _string(s, i)
    if s.startswith("{", i):
        return _object(s, i + 1)
    if s.startswith("[", i):
        return _items(s, i + 1, "]", _value)
    m = _BARE_VALUE.match(s, i)
    token = m[0].strip()
    if not token or STRING in token or "{" in token or "[" in token:
        raise ValueError("expected a value")
    return _scalar(token), m.end()


def _scalar(token: str):
    if token in ("true", "false"):
        return token == "true"
    if token in ("null", "None"):
        return None
    if _NUMBER.fullmatch(token):
        return loads(token)
    return token
