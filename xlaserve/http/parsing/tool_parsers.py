"""Tool-call parsers (`--tool-call-parser`): find a model's tool calls in its text output.

The names and formats are SGLang's (`llama4_json` is vLLM's; `gemma4` is both servers' name):
- `qwen25` (alias `qwen`): Hermes style, used by Qwen2.5/Qwen3 and many fine-tunes; one block per
  call, text may come before, between and after the blocks:
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
- `llama3`: `<|python_tag|>{"name": "f", "parameters": {...}}` (or `"arguments"`), or bare JSON when
  the whole output (after whitespace) starts with such an object; parallel calls are separated
  by `;`. A bare object must have `name` and `parameters`/`arguments` keys, so a JSON answer
  like `{"name": "Alice", "age": 3}` stays content.
- `mistral`: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`, or the compact form of
  newer Mistral models, `[TOOL_CALLS]f[ARGS]{...}` (repeated for parallel calls).
- `deepseekv3`: `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`,
  then `<｜tool▁calls▁end｜>` (full-width bars, U+2581 for the spaces).
  `deepseekv31`: the same markers, per call
  `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
- `kimi_k2`: `<|tool_calls_section_begin|>` then per call
  `<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then
  `<|tool_calls_section_end|>` (special tokens). The model's id (`functions.f:0`) is the call's
  id in the response, as SGLang returns it: Kimi's chat template writes it back into the prompt
  of the next turn.
- `pythonic` (also `llama4`, the name SGLang's docs give Llama 4's parser; vLLM's
  `llama4_pythonic` is an alias of the flag): `[f(a=1), g(b="x")]`, Python call syntax parsed with
  `ast`: keyword arguments with literal values only (a positional argument or a non-literal makes
  it not a call). `<|python_start|>`/`<|python_end|>` (Llama 4) are dropped.
- `llama4_json` (vLLM's name; there its llama3_json parser): `llama3`'s JSON calls as Llama 4's own
  chat template writes them, `<|python_start|>TEXT<|python_end|>{"name": "f", "parameters":
  {...}}{"name": ...}`: the two markers dropped, a bare call allowed right after either.
- `gemma4`: `<|tool_call>call:f{a:<|"|>x<|"|>,n:1}<tool_call|>`, one block per call, Gemma 4's own
  argument syntax: gemma4_tools.py.
- `gpt-oss`: OpenAI Harmony messages whose header names a function as recipient, the `to=` after
  the channel or before it:
  `<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>`
  or `<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{...}<|call|>`; the
  first message of the output has no `<|start|>assistant` (the prompt ends with it), and
  `<|call|>`, a stop token, is usually absent. The markers are special tokens. With
  `--reasoning-parser gpt-oss` the content is the final channel's text (the reasoning parser
  passes only tool-call messages through with their markers); without it, the other messages stay
  in the content, markers and all. A message to anyone else (a built-in tool such as
  `browser.search`) is not a function call: content.

How the output is split into content and call regions, whole or streamed: tool_regions.py.

`arguments` is `json.dumps(arguments, ensure_ascii=False)` of the parsed arguments object.
"""
from __future__ import annotations

import ast
import re

from xlaserve.http.parsing.gemma4_tools import Gemma4Parser
from xlaserve.http.parsing.reasoning import (H_CALL, H_CHANNEL, H_END, H_MESSAGE, H_RETURN,
                                            H_START, held_suffix)
from xlaserve.http.parsing.tool_regions import (EndMarkerParser, RegionParser, ToolCall,
                                                cut_region, dumps, json_calls, loads, skip_ws,
                                                to_call)


class Qwen25Parser(EndMarkerParser):
    starts, end = ("<tool_call>",), "</tool_call>"

    def _body(self, body, final):
        return json_calls(body)


class DeepSeekV3Parser(EndMarkerParser):
    starts, end = ("<｜tool▁call▁begin｜>",), "<｜tool▁call▁end｜>"
    drops = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    # function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```
    _BODY = re.compile(r"\s*\w*\s*<｜tool▁sep｜>\s*([^\n]*?)\s*\n\s*```(?:json)?[ \t]*\n(.*?)\s*(```\s*)?",
                       re.S)

    def _body(self, body, final):
        m = self._BODY.fullmatch(body)
        if m is None or not (m[3] or final):  # the closing ``` may only be missing in a cut call
            return None
        return self._call(m[1], m[2])

    @staticmethod
    def _call(name: str, args: str) -> list[ToolCall] | None:
        try:
            call = to_call({"name": name, "arguments": loads(args)})
        except ValueError:
            return None
        return [call] if call else None


class DeepSeekV31Parser(DeepSeekV3Parser):
    _BODY = re.compile(r"\s*([^\s<]+)\s*<｜tool▁sep｜>(.*)", re.S)

    def _body(self, body, final):
        m = self._BODY.fullmatch(body)
        return self._call(m[1], m[2]) if m else None


class KimiK2Parser(EndMarkerParser):
    starts, end = ("<|tool_call_begin|>",), "<|tool_call_end|>"
    drops = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    # functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS (the prefix and index optional)
    _BODY = re.compile(r"\s*((?:functions\.)?([^\s<]+?)(?::\d+)?)\s*"
                       r"<\|tool_call_argument_begin\|>\s*(.*?)\s*", re.S)

    def _body(self, body, final):
        m = self._BODY.fullmatch(body)
        if m is None:
            return None
        try:
            arguments = loads(m[3])
        except ValueError:
            return None
        return [ToolCall(m[2], dumps(arguments), m[1])] if isinstance(arguments, dict) else None


class MistralParser(RegionParser):
    starts = ("[TOOL_CALLS]",)
    _COMPACT = re.compile(r"\s*([\w.\-]+)\[ARGS\]\s*")
    _COMPACT_SO_FAR = re.compile(r"\s*[\w.\-]*(\[(A(R(G(S)?)?)?)?)?")

    def _region(self, s, final):
        p = len(self.starts[0])
        q = skip_ws(s, p)
        if q == len(s):
            return cut_region(final, s)
        if s[q] in "[{":  # [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
            e = self._match_end(s, q)
            return cut_region(final, s) if e is None else (e, json_calls(s[q:e], many=True))
        m = self._COMPACT.match(s, p)  # [TOOL_CALLS]name[ARGS]{...}
        if m is None:
            if self._COMPACT_SO_FAR.fullmatch(s, p):
                return cut_region(final, s)
            return p, None
        q = m.end()
        if q == len(s):
            return cut_region(final, s)
        if s[q] != "{":
            return q, None
        e = self._match_end(s, q)
        if e is None:
            return cut_region(final, s)
        try:
            call = to_call({"name": m[1], "arguments": loads(s[q:e])})
        except ValueError:
            call = None
        return e, [call] if call else None


class Llama3Parser(RegionParser):
    starts = ("<|python_tag|>",)
    _CALL_START = re.compile(r'\{\s*"name"\s*:')

    def _opens_bare(self) -> str:
        """What opens a call without a marker here: `{` at the very start, `;` or `{` after a
        call, nothing after text."""
        return "{" if self._last is None else ";{" if self._last == "call" else ""

    def _bare(self) -> bool:
        """Whether a `{` here is a bare call (its object must then have name and arguments)."""
        return self._last is None

    def _next_start(self, buf):
        i = super()._next_start(buf)
        opens = self._opens_bare()
        if opens:
            j = skip_ws(buf, 0)
            if j < len(buf) and buf[j] in opens:
                i = j if i is None else min(i, j)
        return i

    def _region(self, s, final):
        bare = s[0] == "{" and self._bare()
        p = len(self.starts[0]) if s.startswith(self.starts[0]) else 1 if s[0] == ";" else 0
        q = skip_ws(s, p)
        if q == len(s):
            return cut_region(final, s)
        if s[q] != "{":  # e.g. <|python_tag|> before code: not a call
            return p, None
        e = self._match_end(s, q)
        if e is None:
            return cut_region(final, s, clear=not bare or bool(self._CALL_START.match(s, q)))
        return e, json_calls(s[q:e], bare=bare)


class Llama4JsonParser(Llama3Parser):
    """Llama 4's JSON calls as its own chat template writes them (vLLM's llama4_json, which is
    its llama3_json parser): the assistant's text between `<|python_start|>` and `<|python_end|>`,
    then the calls, `{"name": "f", "parameters": {...}}` one after the other. The two markers are
    dropped, and a bare `{` right after either may open a call, as at the very start."""
    starts = ("<|python_tag|>", "<|python_start|>", "<|python_end|>")

    def __init__(self, tools=None):
        super().__init__(tools)
        self._after_marker = False  # only whitespace since <|python_start|> or <|python_end|>

    def _opens_bare(self):
        return super()._opens_bare() or ("{" if self._after_marker else "")

    def _bare(self):
        return super()._bare() or self._after_marker

    def _text(self, text, out):
        if text.strip():
            self._after_marker = False
        super()._text(text, out)

    def _region(self, s, final):
        marker = next((m for m in self.starts[1:] if s.startswith(m)), None)
        if marker is not None:
            self._after_marker = True
            return len(marker), []
        decided = super()._region(s, final)
        if decided is not None:
            self._after_marker = False
        return decided


class PythonicParser(RegionParser):
    starts = ("[",)
    drops = ("<|python_start|>", "<|python_end|>")
    _HEAD = re.compile(r"\[\s*[^\W\d]\w*\s*\(")
    _HEAD_SO_FAR = re.compile(r"\[\s*([^\W\d]\w*\s*)?")

    def _region(self, s, final):
        if not self._HEAD.match(s):
            return None if not final and self._HEAD_SO_FAR.fullmatch(s) else (1, None)
        e = self._match_end(s, 0, "\"'")
        return cut_region(final, s) if e is None else (e, self._calls(s[:e]))

    @staticmethod
    def _calls(text: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(text, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return None
                if any(k.arg is None for k in node.keywords):  # **kwargs
                    return None
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                calls.append(ToolCall(node.func.id, dumps(args)))
            return calls
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None


class GptOssParser(RegionParser):
    starts = (H_START, H_CHANNEL)
    _RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")
    _TERMINATORS = (H_CALL, H_END, H_RETURN)

    def _region(self, s, final):
        header_end, marker = _first(s, len(H_START if s.startswith(H_START) else H_CHANNEL),
                                    (H_MESSAGE, H_START) + self._TERMINATORS)
        recipient = self._RECIPIENT.search(s, 0, header_end)
        if marker is None:  # the header goes on
            if not final:
                return None
            return len(s), [] if recipient else None
        if recipient is None or marker == H_START:  # not a call: the header is content
            return header_end + (len(marker) if marker == H_MESSAGE else 0), None
        if marker != H_MESSAGE:  # a terminator right after the header: a call without arguments
            return header_end + len(marker), [ToolCall(recipient[1], "{}")] if marker == H_CALL else None
        body = header_end + len(H_MESSAGE)
        # The body ends at its terminator, or where the next message starts.
        end, marker = _first(s, body, (H_START, H_CHANNEL) + self._TERMINATORS)
        if marker is None:
            if not final:
                return None
            return len(s), self._call(recipient[1], s[body:len(s) - held_suffix(s, *self._TERMINATORS)]) or []
        return end + (len(marker) if marker in self._TERMINATORS else 0), self._call(recipient[1], s[body:end])

    @staticmethod
    def _call(name: str, arguments: str) -> list[ToolCall] | None:
        try:
            value = loads(arguments)
        except ValueError:
            return None
        return [ToolCall(name, dumps(value))] if isinstance(value, dict) else None


def _first(s: str, start: int, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the first of `markers` occurs in s from `start`, and which: (len(s), None) if none."""
    found = [(at, m) for m in markers if (at := s.find(m, start)) != -1]
    return min(found) if found else (len(s), None)


TOOL_CALL_PARSERS: dict[str, type] = {
    "qwen25": Qwen25Parser,
    "qwen": Qwen25Parser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "deepseekv3": DeepSeekV3Parser,
    "deepseekv31": DeepSeekV31Parser,
    "kimi_k2": KimiK2Parser,
    "pythonic": PythonicParser,
    "llama4": PythonicParser,
    "llama4_json": Llama4JsonParser,
    "gpt-oss": GptOssParser,
    "gemma4": Gemma4Parser,
}
