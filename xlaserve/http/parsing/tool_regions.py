"""What every tool-call parser (tool_parsers.py) shares: the call and delta types, strict JSON,
and the streaming machinery that splits a model's output into content and call *regions*, each
format saying only where its regions start and what a region holds (`_region`).

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
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from xlaserve.http.parsing.reasoning import held_suffix


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text
    call_id: str | None = None  # the model's own id for the call (Kimi K2's), else None: ours


@dataclass
class ToolCallDelta:
    index: int  # the call's position in this choice
    name: str | None  # on the call's first delta only
    arguments: str  # a fragment of the arguments text
    call_id: str | None = None  # on the first delta, where the model named the call


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def loads(text: str):
    """json.loads, raising ValueError on anything that is not strict JSON (NaN included)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ValueError("too deep") from e


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def to_call(obj, bare: bool = False) -> ToolCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} -> a call, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if bare and "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj["parameters"] if "parameters" in obj else obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    return ToolCall(obj["name"], dumps(args)) if isinstance(args, dict) else None


def json_calls(text: str, many: bool = False, bare: bool = False) -> list[ToolCall] | None:
    """The calls in a JSON object (or, if `many`, an array of them); None unless all are calls."""
    try:
        value = loads(text)
    except ValueError:
        return None
    objs = value if many and isinstance(value, list) else [value]
    calls = [to_call(obj, bare) for obj in objs]
    return calls if calls and all(calls) else None


_NON_SPACE = re.compile(r"\S")


def skip_ws(s: str, i: int) -> int:
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


class RegionParser:
    """One choice's output, fed piece by piece: a format gives `starts`, `drops` and `_region`."""
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
                calls.append(ToolCall(delta.name, "", delta.call_id))
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
                deltas += [ToolCallDelta(self._index, call.name, "", call.call_id),
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


def cut_region(final: bool, s: str, clear: bool = True):
    """An unfinished region: undecided, or at the end dropped if it clearly started a call."""
    return None if not final else (len(s), [] if clear else None)


class EndMarkerParser(RegionParser):
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
