"""Reasoning parsers (`--reasoning-parser`): split a model's thinking from its answer.

With `separate_reasoning` (the default) the reasoning goes to `reasoning_content` and the rest to
`content`. Most families write their reasoning between a start and an end tag; they differ in the
tags and in where reasoning starts:
- `qwen3`: `<think>...</think>`, only where the output opens the block (with
  `enable_thinking: false` the template closes the block in the prompt: everything is content);
- `deepseek-r1`, `qwen3-thinking`: from the first token, because their templates put `<think>`
  in the prompt; everything up to `</think>` is reasoning, all of it if the tag never comes;
- `deepseek-v3` (V3.1/V3.2, hybrid): from the first token only when the request's
  `chat_template_kwargs` has `thinking: true` (the template then opens `<think>` in the prompt);
  otherwise like `qwen3`, so a plain answer is all content;
- `kimi`: Kimi's `◁think▷...◁/think▷`, where the output opens the block (Kimi-VL);
- `kimi_k2`: Kimi K2's `<think>...</think>`, where the output opens the block; a tool-call
  section (`<|tool_calls_section_begin|>`) also ends the reasoning, and stays in the content for
  the `kimi_k2` tool-call parser (SGLang's KimiK2Detector). Its markers are special tokens;
- `gemma4`: Gemma 4's thinking channel, `<|channel>thought\n...<channel|>`, where the output opens
  it (the template asks for thinking with `enable_thinking`); the channel's name, `thought`, is
  not reasoning. A tool call (`<|tool_call>`) also ends the reasoning and stays in the content
  for the `gemma4` tool-call parser (the template closes the channel before its calls). Its
  markers are special tokens;
- `gpt-oss`: OpenAI's Harmony channels, not tags: see `_HarmonySplitter`. Its markers are special
  tokens, so the output must be detokenized with `skip_special_tokens=False`
  (`needs_special_tokens`).
Any parser starts inside the reasoning when the prompt itself ends by opening the block
(`ReasoningParser.for_request` looks). Streaming text arrives in arbitrary pieces, so a piece that
may be the start of a tag or marker is held back until the next piece decides it; any cut of the
same output gives the same reasoning and content.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

THINK_START, THINK_END = "<think>", "</think>"
KIMI_START, KIMI_END = "\u25c1think\u25b7", "\u25c1/think\u25b7"  # ◁think▷ ◁/think▷
KIMI_TOOL_SECTION = "<|tool_calls_section_begin|>"  # Kimi K2's tool calls, a special token
GEMMA4_START, GEMMA4_END = "<|channel>", "<channel|>"  # Gemma 4's channel, special tokens

# Harmony (gpt-oss) markers: each one special token.
H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
H_END, H_RETURN, H_CALL = "<|end|>", "<|return|>", "<|call|>"
HARMONY_MARKERS = (H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN, H_END, H_RETURN, H_CALL)
HARMONY_ANALYSIS = H_CHANNEL + "analysis" + H_MESSAGE  # opens a reasoning message


@dataclass(frozen=True)
class ParserSpec:
    start: str  # what opens the reasoning (the tag; for gpt-oss the analysis message header)
    end: str
    forced: bool = False  # reasoning from the first token: the template always opens the block
    toggle: str | None = None  # chat_template_kwargs key whose true value opens it in the prompt
    harmony: bool = False  # Harmony channels instead of tags
    special_tokens: bool = False  # the markers are special tokens: keep them when detokenizing
    # A marker that also ends the reasoning and opens the content, itself included (Kimi K2's
    # tool-call section, which may come before </think>).
    content_marker: str | None = None
    label: str | None = None  # text right after the start that names the block: not reasoning


PARSERS: dict[str, ParserSpec] = {
    "qwen3": ParserSpec(THINK_START, THINK_END),
    "qwen3-thinking": ParserSpec(THINK_START, THINK_END, forced=True),
    "deepseek-r1": ParserSpec(THINK_START, THINK_END, forced=True),
    "deepseek-v3": ParserSpec(THINK_START, THINK_END, toggle="thinking"),
    "kimi": ParserSpec(KIMI_START, KIMI_END),
    "kimi_k2": ParserSpec(THINK_START, THINK_END, special_tokens=True,
                          content_marker=KIMI_TOOL_SECTION),
    "gemma4": ParserSpec(GEMMA4_START, GEMMA4_END, special_tokens=True, content_marker="<|tool_call>",
                         label="thought\n"),
    "gpt-oss": ParserSpec(HARMONY_ANALYSIS, H_END, harmony=True, special_tokens=True),
}


def _spec(name: str) -> ParserSpec:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]


def needs_special_tokens(name: str | None) -> bool:
    """Whether the parser reads special tokens (gpt-oss): detokenize with skip_special_tokens=False."""
    return name is not None and _spec(name).special_tokens


def held_suffix(text: str, *tags: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `tags`."""
    held = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), held, -1):
            if text.endswith(tag[:n]):
                held = n
                break
    return held


class ReasoningParser:
    """One choice's output -> (reasoning, content): `feed` pieces then `finish`, or `parse` it whole."""

    def __init__(self, name: str, *, thinking_in_prompt: bool = False,
                 chat_template_kwargs: Mapping[str, Any] | None = None):
        spec = _spec(name)
        self.name = name
        # Reasoning from the first token: the parser says so, the prompt left the block open, or
        # the request switched the template's thinking on (deepseek-v3's `thinking`).
        forced = spec.forced or thinking_in_prompt or bool(
            spec.toggle and (chat_template_kwargs or {}).get(spec.toggle))
        self._splitter = _HarmonySplitter(forced) if spec.harmony else _TagSplitter(spec, forced)

    @classmethod
    def for_request(cls, name: str, *, prompt_text: str = "",
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> "ReasoningParser":
        """The parser for one chat request: starts inside the reasoning when the rendered prompt
        ends by opening the block, or when the request's template kwargs turned thinking on."""
        thinking_in_prompt = prompt_text.rstrip().endswith(_spec(name).start)
        return cls(name, thinking_in_prompt=thinking_in_prompt,
                   chat_template_kwargs=chat_template_kwargs)

    @property
    def state(self) -> str:
        """"start" (undecided), "reasoning" (inside a reasoning block) or "content"."""
        return self._splitter.state

    @property
    def had_reasoning(self) -> bool:
        return self._splitter.had_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        """A new piece of output -> (reasoning delta, content delta)."""
        return self._splitter.feed(text)

    def finish(self) -> tuple[str, str]:
        """The output ended: whatever was held back goes where it was heading."""
        return self._splitter.finish()

    def parse(self, text: str) -> tuple[str | None, str]:
        """The whole output at once -> (reasoning, or None if there was none; content)."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        reasoning = (reasoning + more_reasoning).strip()
        return (reasoning if self.had_reasoning else None), content + more_content


class _TagSplitter:
    """`START reasoning END content`, the start tag optional when `forced`."""

    def __init__(self, spec: ParserSpec, forced: bool):
        self.start_tag, self.end_tag = spec.start, spec.end
        self.content_marker = spec.content_marker
        self.forced = forced
        self._spec_label = spec.label
        self._label = spec.label if forced else None  # still to drop, right after the start
        self.state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self.had_reasoning = False
        self._buffer = ""
        self._skip_newlines = False  # right after a tag: the newlines that set it apart

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while self._buffer:
            if self._label is not None and self.state == "reasoning":
                if self._buffer.startswith(self._label):
                    self._buffer = self._buffer[len(self._label):]
                elif self._label.startswith(self._buffer):
                    break  # maybe the label: wait
                self._label = None
                continue
            if self._skip_newlines:
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer:
                    break
                self._skip_newlines = False
            if self.state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(self.start_tag):  # the model opens the block itself
                    self._buffer = stripped[len(self.start_tag):]
                    self.state, self._skip_newlines = "reasoning", True
                    self._label = self._spec_label
                elif self.start_tag.startswith(stripped):
                    break  # only whitespace or a partial start tag so far
                else:
                    self.state = "reasoning" if self.forced else "content"
                self.had_reasoning = self.state == "reasoning"
            elif self.state == "reasoning":
                at = self._buffer.find(self.end_tag)
                marker = (self._buffer.find(self.content_marker, 0, None if at == -1 else at)
                          if self.content_marker else -1)
                if marker != -1:  # the content starts with the marker: no end tag to drop
                    reasoning.append(self._buffer[:marker])
                    self._buffer = self._buffer[marker:]
                    self.state = "content"
                    continue
                if at != -1:
                    reasoning.append(self._buffer[:at])
                    self._buffer = self._buffer[at + len(self.end_tag):]
                    self.state, self._skip_newlines = "content", True
                    continue
                keep = held_suffix(self._buffer, self.end_tag,
                                   *((self.content_marker,) if self.content_marker else ()))
                reasoning.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            else:
                content.append(self._buffer)
                self._buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.forced and rest.strip()):
            self.had_reasoning = True
            return rest, ""
        return "", rest


_CHANNEL = re.compile(re.escape(H_CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class _HarmonySplitter:
    """OpenAI Harmony output (gpt-oss), after the prompt's `<|start|>assistant`:

        <|channel|>analysis<|message|>REASONING<|end|>
        <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

    A message is a header (`<|start|>ROLE`, `<|channel|>NAME`, maybe ` to=RECIPIENT` and
    `<|constrain|>TYPE`), `<|message|>`, a body, and `<|end|>`, `<|return|>` or `<|call|>` (the
    last two are stop tokens, so usually absent from the text). By message:
    - channel `analysis` (no recipient): the body is reasoning; a later analysis message's text
      follows a newline;
    - a recipient (`commentary to=functions.NAME`, or a built-in tool): a tool call, passed into
      the content verbatim, markers and all, from its `<|start|>` or `<|channel|>` through its
      terminator, for a tool-call parser to read;
    - any other channel (`final`; `commentary` without recipient, a preamble shown to the user):
      the body is content; a later such message's text follows a newline.
    Text outside any message (an output with no markers at all) is content, but not whitespace
    between messages; stray markers go.
    A `<|start|>` or `<|channel|>` inside a body closes it, as if its terminator had come (for a
    tool call, `<|call|>` is then put in the content, so the call's arguments end there).
    """

    def __init__(self, forced: bool):
        self.mode = "body" if forced else "idle"  # "idle" | "header" | "body"
        self.kind = "reasoning" if forced else None  # the body's: "reasoning" | "text" | "tool"
        self.had_reasoning = forced
        self._started = forced  # a message (or text) seen: state is no longer "start"
        self._header = ""
        self._buffer = ""
        self._seen = {"reasoning": False, "text": False}  # an earlier message of the kind had text
        self._gap = ""  # whitespace outside messages: dropped if a message follows
        self._message_emitted = False  # the current message's body had text

    @property
    def state(self) -> str:
        if self.mode == "body" and self.kind == "reasoning":
            return "reasoning"
        return "content" if self._started else "start"

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        out = {"reasoning": [], "content": []}
        while self._buffer:
            at, marker = self._next_marker()
            if marker is None:
                keep = held_suffix(self._buffer, *HARMONY_MARKERS)
                self._text(self._buffer[:len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            self._text(self._buffer[:at], out)
            self._buffer = self._buffer[at + len(marker):]
            self._marker(marker, out)
        return "".join(out["reasoning"]), "".join(out["content"])

    def finish(self) -> tuple[str, str]:
        out = {"reasoning": [], "content": []}
        rest, self._buffer = self._buffer, ""
        self._text(rest, out)
        if self.mode == "header" and _RECIPIENT.search(self._header):
            out["content"].append(self._header)  # a tool call cut inside its header
        if not self._started:
            out["content"].append(self._gap)  # an output of whitespace alone stays what it was
        self._gap = ""
        self.mode, self.kind, self._header = "idle", None, ""
        return "".join(out["reasoning"]), "".join(out["content"])

    def _next_marker(self) -> tuple[int, str | None]:
        best, found = len(self._buffer), None
        for marker in HARMONY_MARKERS:
            at = self._buffer.find(marker, 0, best + len(marker))
            if at != -1 and at < best:
                best, found = at, marker
        return best, found

    def _text(self, text: str, out: dict) -> None:
        if not text:
            return
        if self.mode == "header":
            self._header += text
            return
        if self.mode == "idle":
            text, self._gap = self._gap + text, ""
            if not text.strip():
                self._gap = text
                return
        self._started = True
        if self.mode == "idle" or self.kind == "tool":
            out["content"].append(text)
            return
        kind = self.kind
        if not self._message_emitted and self._seen[kind]:
            text = "\n" + text
        self._message_emitted = self._seen[kind] = True
        out["reasoning" if kind == "reasoning" else "content"].append(text)

    def _marker(self, marker: str, out: dict) -> None:
        self._started = True
        if self.mode == "body":
            if marker in (H_START, H_CHANNEL):  # a new message: this one ended without terminator
                if self.kind == "tool":  # the tool-call parser must see where its call ended
                    out["content"].append(H_CALL)
                self.mode, self.kind = "idle", None
            else:
                if self.kind == "tool":
                    out["content"].append(marker)
                if marker in (H_END, H_RETURN, H_CALL):
                    self.mode, self.kind = "idle", None
                return  # (a stray <|message|> or <|constrain|> in a text body goes)
        if self.mode == "idle":
            self._gap = ""
            if marker in (H_START, H_CHANNEL):
                self.mode, self._header = "header", marker
            return  # a terminator with no message open goes
        # in a header
        if marker == H_START:
            self._header = marker  # a new message: the unfinished header goes
        elif marker in (H_CHANNEL, H_CONSTRAIN):
            self._header += marker
        elif marker == H_MESSAGE:
            self._open_body(out)
        else:  # a terminator before any <|message|>: a tool call without arguments, or nothing
            if _RECIPIENT.search(self._header):
                out["content"].append(self._header + marker)
            self.mode, self._header = "idle", ""

    def _open_body(self, out: dict) -> None:
        header, self._header = self._header, ""
        channel = _CHANNEL.search(header)
        self.mode, self._message_emitted = "body", False
        if _RECIPIENT.search(header):
            self.kind = "tool"
            out["content"].append(header + H_MESSAGE)
        elif channel is not None and channel.group(1).lower() == "analysis":
            self.kind, self.had_reasoning = "reasoning", True
        else:
            self.kind = "text"
