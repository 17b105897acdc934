"""Tool-call parsers (`--tool-call-parser`): find a model's tool calls in its text output.

The names and formats are SGLang's:
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
- `pythonic`: `[f(a=1), g(b="x")]`, Python call syntax parsed with `ast`: keyword arguments with
  literal values only (a positional argument or a non-literal makes it not a call).
  `<|python_start|>`/`<|python_end|>` (Llama 4) are dropped.

How the output is split. The parser scans for *regions*: the markup of one call (qwen25,
deepseek: one block; llama3: one JSON object) or of one group of calls (mistral: one array;
pythonic: one list). A region is all or nothing:
- complete and valid: it becomes tool calls and its markup leaves the content;
- complete but not valid (malformed JSON, wrong shape, not literals) or calling a function that is
  not in `tools` (when `tools` is given): the whole region stays content, verbatim, and no call;
- cut off (the output ended inside it, e.g. by `max_tokens`): it is dropped, from the calls AND
  from the content, when its opening clearly started a call (a marker, `;` after a call, a bare
  `{"name":`, a pythonic `[name(`); otherwise (a bare `{...` or `[...` that was not yet a call)
  it stays content. A cut region whose call is already whole (only the end marker is missing,
  e.g. `...}}\\n</tool` at the end) still gives the call.
Whitespace that only separates content from a call region is dropped: "Let me check.\\n\\n<tool_call>
..." gives the content "Let me check." (text after the calls is kept, stripped on the left).

Streaming (`feed` each new piece, then `finish`): content is emitted as soon as it is decided;
text that may still become markup is held back until the next pieces decide it: the end of the
text if it may be the start of a marker (`<tool_`, `[TOOL`, `<|python`, `<｜tool`), a region
until it is complete, trailing whitespace (it may precede a call), a leading `{` (llama3 bare
JSON), a `[` (pythonic). So no markup reaches the streamed content whatever the piece boundaries,
and a call is emitted only once complete (a cut call never shows up): its first delta carries its
index and name with arguments "", the second its whole arguments. `parse(text)` is `feed(text)` +
`finish()` on a fresh parser, and the decisions never depend on where the pieces were cut, so
streaming and `parse` give the same content and the same calls.

`arguments` is `json.dumps(arguments, ensure_ascii=False)` of the parsed arguments object.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from xlaserve.http.parsing.reasoning import held_suffix


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text


@dataclass
class ToolCallDelta:
    index: int  # the call's position in this choice
    name: str | None  # on the call's first delta only
    arguments: str  # a fragment of the arguments text


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    """json.loads, raising ValueError on anything that is not strict JSON (NaN included)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ValueError("too deep") from e


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _to_call(obj, bare: bool = False) -> ToolCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} -> a call, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if bare and "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj["parameters"] if "parameters" in obj else obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = _loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    return ToolCall(obj["name"], _dumps(args)) if isinstance(args, dict) else None


def _json_calls(text: str, many: bool = False, bare: bool = False) -> list[ToolCall] | None:
    """The calls in a JSON object (or, if `many`, an array of them); None unless all are calls."""
    try:
        value = _loads(text)
    except ValueError:
        return None
    objs = value if many and isinstance(value, list) else [value]
    calls = [_to_call(obj, bare) for obj in objs]
    return calls if calls and all(calls) else None


_NON_SPACE = re.compile(r"\S")


def _skip_ws(s: str, i: int) -> int:
    m = _NON_SPACE.search(s, i)
    return m.start() if m else len(s)


_OUTSIDE = {'"': re.compile(r'[][{}()"]'), "\"'": re.compile(r"""[][{}()"']""")}
_INSIDE = {'"': re.compile(r'["\\]'), "'": re.compile(r"['\\]")}


class _BracketScan:
    """Where the bracket at s[start] closes, skipping strings (quoted by one of `quotes`); it
    resumes where it stopped, so a region streamed in many pieces is scanned once."""

    def __init__(self, start: int, quotes: str):
        self.pos, self.depth, self.quote, self.end = start, 0, None, None
        self.quotes = quotes

    def __call__(self, s: str) -> int | None:
        while self.end is None:
            m = (_INSIDE[self.quote] if self.quote else _OUTSIDE[self.quotes]).search(s, self.pos)
            if m is None or m.group() == "\\" and m.end() == len(s):  # (an escape: its next char)
                self.pos = len(s) if m is None else m.start()
                return None
            c, self.pos = m.group(), m.end()
            if c == "\\":
                self.pos += 1
            elif self.quote:
                self.quote = None  # the closing quote
            elif c in self.quotes:
                self.quote = c
            elif c in "[{(":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
        return self.end


class _Parser:
    starts: tuple[str, ...] = ()  # markers that open a call region
    drops: tuple[str, ...] = ()  # markers dropped from the content

    def __init__(self, tools: list[dict] | None = None):
        self._tools = tools
        self._names = {(t.get("function") or {}).get("name") for t in tools} if tools else None
        self._buf = ""  # text not decided yet
        self._ws = ""  # trailing whitespace of the content, held back (a call may follow)
        self._after_call = False  # drop the whitespace that starts the next content
        self._last = None  # the last non-blank thing consumed: None, "text" or "call"
        self._index = 0
        self._scans: dict[tuple[int, str], _BracketScan] = {}  # of the undecided region

    def _match_end(self, s: str, i: int, quotes: str = '"') -> int | None:
        """Index just past the bracket closing the one at s[i] (s: the undecided region, which
        only grows until decided), skipping strings; None while it is open."""
        scan = self._scans.get((i, quotes))
        if scan is None:
            scan = self._scans[(i, quotes)] = _BracketScan(i, quotes)
        return scan(s)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        parser = type(self)(self._tools)
        content, deltas = parser.feed(text)
        rest, more = parser.finish()
        calls: list[ToolCall] = []
        for delta in deltas + more:
            if delta.name is not None:
                calls.append(ToolCall(delta.name, ""))
            calls[delta.index].arguments += delta.arguments
        return content + rest, calls

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            i = self._next_start(self._buf)
            if i is None:  # all content, but for the start of a marker at the end
                cut = len(self._buf) - (0 if final else held_suffix(self._buf, *self.starts, *self.drops))
                self._text(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                break
            self._text(self._buf[:i], out)
            self._buf = self._buf[i:]
            drop = next((d for d in self.drops if self._buf.startswith(d)), None)
            decided = (len(drop), []) if drop else self._region(self._buf, final)
            if decided is None:  # wait for more text
                break
            end, calls = decided
            self._scans.clear()
            region, self._buf = self._buf[:end], self._buf[end:]
            if calls and self._names is not None and any(c.name not in self._names for c in calls):
                calls = None
            if calls is None:  # not a call: the region is content
                self._text(region, out)
                continue
            self._ws, self._after_call = "", True  # a call, or markup that is dropped
            for call in calls:
                deltas += [ToolCallDelta(self._index, call.name, ""),
                           ToolCallDelta(self._index, None, call.arguments)]
                self._index += 1
                self._last = "call"
        if final:
            out.append(self._ws)
            self._ws = ""
        return "".join(out), deltas

    def _text(self, text: str, out: list[str]) -> None:
        """Content, holding back its trailing whitespace."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            out.append(body)
            self._last = "text"

    def _next_start(self, buf: str) -> int | None:
        """Where the first region (or dropped marker) starts in `buf`, None if there is none."""
        found = [i for i in (buf.find(m) for m in self.starts + self.drops) if i >= 0]
        return min(found) if found else None

    def _region(self, s: str, final: bool):
        """`s` starts with a region: None while undecided (never when `final`), else (end, calls)
        with calls None for "content", [] for "dropped" (a cut call)."""
        raise NotImplementedError


def _cut(final: bool, s: str, clear: bool = True):
    """An unfinished region: undecided, or at the end dropped if it clearly started a call."""
    return None if not final else (len(s), [] if clear else None)


class _EndMarkerParser(_Parser):
    """Regions from a start marker to an end marker, with a body parsed by `_body`."""
    end = ""

    def _region(self, s, final):
        n = len(self.starts[0])
        e = s.find(self.end, n)
        if e >= 0:
            return e + len(self.end), self._body(s[n:e], final=False)
        if not final:
            return None
        return len(s), self._body(s[n:len(s) - held_suffix(s, self.end)], final=True) or []

    def _body(self, body: str, final: bool) -> list[ToolCall] | None:
        raise NotImplementedError


class Qwen25Parser(_EndMarkerParser):
    starts, end = ("<tool_call>",), "</tool_call>"

    def _body(self, body, final):
        return _json_calls(body)


class DeepSeekV3Parser(_EndMarkerParser):
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
            call = _to_call({"name": name, "arguments": _loads(args)})
        except ValueError:
            return None
        return [call] if call else None


class DeepSeekV31Parser(DeepSeekV3Parser):
    _BODY = re.compile(r"\s*([^\s<]+)\s*<｜tool▁sep｜>(.*)", re.S)

    def _body(self, body, final):
        m = self._BODY.fullmatch(body)
        return self._call(m[1], m[2]) if m else None


class MistralParser(_Parser):
    starts = ("[TOOL_CALLS]",)
    _COMPACT = re.compile(r"\s*([\w.\-]+)\[ARGS\]\s*")
    _COMPACT_SO_FAR = re.compile(r"\s*[\w.\-]*(\[(A(R(G(S)?)?)?)?)?")

    def _region(self, s, final):
        p = len(self.starts[0])
        q = _skip_ws(s, p)
        if q == len(s):
            return _cut(final, s)
        if s[q] in "[{":  # [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
            e = self._match_end(s, q)
            return _cut(final, s) if e is None else (e, _json_calls(s[q:e], many=True))
        m = self._COMPACT.match(s, p)  # [TOOL_CALLS]name[ARGS]{...}
        if m is None:
            if self._COMPACT_SO_FAR.fullmatch(s, p):
                return _cut(final, s)
            return p, None
        q = m.end()
        if q == len(s):
            return _cut(final, s)
        if s[q] != "{":
            return q, None
        e = self._match_end(s, q)
        if e is None:
            return _cut(final, s)
        try:
            call = _to_call({"name": m[1], "arguments": _loads(s[q:e])})
        except ValueError:
            call = None
        return e, [call] if call else None


class Llama3Parser(_Parser):
    starts = ("<|python_tag|>",)
    _CALL_START = re.compile(r'\{\s*"name"\s*:')

    def _next_start(self, buf):
        i = super()._next_start(buf)
        if self._last != "text":  # at the very start: bare JSON; after a call: `;` or the next `{`
            j = _skip_ws(buf, 0)
            if j < len(buf) and buf[j] in ("{" if self._last is None else ";{"):
                i = j if i is None else min(i, j)
        return i

    def _region(self, s, final):
        bare = s[0] == "{" and self._last is None
        p = len(self.starts[0]) if s.startswith(self.starts[0]) else 1 if s[0] == ";" else 0
        q = _skip_ws(s, p)
        if q == len(s):
            return _cut(final, s)
        if s[q] != "{":  # e.g. <|python_tag|> before code: not a call
            return p, None
        e = self._match_end(s, q)
        if e is None:
            return _cut(final, s, clear=not bare or bool(self._CALL_START.match(s, q)))
        return e, _json_calls(s[q:e], bare=bare)


class PythonicParser(_Parser):
    starts = ("[",)
    drops = ("<|python_start|>", "<|python_end|>")
    _HEAD = re.compile(r"\[\s*[^\W\d]\w*\s*\(")
    _HEAD_SO_FAR = re.compile(r"\[\s*([^\W\d]\w*\s*)?")

    def _region(self, s, final):
        if not self._HEAD.match(s):
            return None if not final and self._HEAD_SO_FAR.fullmatch(s) else (1, None)
        e = self._match_end(s, 0, "\"'")
        return _cut(final, s) if e is None else (e, self._calls(s[:e]))

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
                calls.append(ToolCall(node.func.id, _dumps(args)))
            return calls
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None


TOOL_CALL_PARSERS: dict[str, type] = {
    "qwen25": Qwen25Parser,
    "qwen": Qwen25Parser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "deepseekv3": DeepSeekV3Parser,
    "deepseekv31": DeepSeekV31Parser,
    "pythonic": PythonicParser,
}
